"""The scheduler's hook for structured outputs (a SchedulerHook) over the
StructuredOutputManager: a constrained request waits (WAITING_FOR_FSM) while its grammar
compiles, so nothing queues behind a slow compile; each step gets the grammar bitmask; the
matcher advances over new tokens, a terminated grammar stops the request, jump-forward
appends the tokens the grammar forces, and drafts are cut to what the grammar accepts."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched_hooks import SchedulerHook, append_tokens

if TYPE_CHECKING:
    from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from kvserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class StructuredOutputScheduling(SchedulerHook):
    def __init__(self, manager: "StructuredOutputManager", max_model_len: int,
                 enable_jump_forward: bool = False) -> None:
        self.manager = manager
        self.max_model_len = max_model_len
        self.enable_jump_forward = enable_jump_forward
        # Requests whose grammar is compiling, in arrival order.
        self.waiting_for_fsm: dict[str, Request] = {}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_for_fsm)

    def add_request(self, request: Request) -> bool:
        if not request.use_structured_output:
            return False
        self.manager.grammar_init(request)
        request.status = RequestStatus.WAITING_FOR_FSM
        self.waiting_for_fsm[request.request_id] = request
        return True

    def take_ready(self) -> list[Request]:
        ready = []
        for rid, request in list(self.waiting_for_fsm.items()):
            if not self.manager.take_ready(request):
                continue
            del self.waiting_for_fsm[rid]
            ready.append(request)
            error = request.structured_output_request.error  # type: ignore[union-attr]
            if error is None:
                request.status = RequestStatus.WAITING
                continue
            logger.warning("Request %s: grammar compilation failed: %s", rid, error)
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = f"grammar compilation failed: {error}"
        return ready

    def on_scheduled(self, output: "SchedulerOutput", requests: dict[str, Request]) -> None:
        if not self.waiting_for_fsm and not self.manager.num_active:
            return
        if output.is_empty:
            # Everything left is waiting for a grammar: wait for one (briefly) instead of
            # spinning the loop against the compile threads.
            self.manager.wait_for_any(list(self.waiting_for_fsm.values()), timeout=0.01)
            return
        output.grammar_bitmask, output.structured_output_request_ids = (
            self.manager.grammar_bitmask(requests, output.num_scheduled_tokens,
                                         output.scheduled_spec_decode_tokens))

    def update_request(self, request: Request, idx: int, new_tokens: list[int],
                       so: "SchedulerOutput", runner_output: "ModelRunnerOutput") -> list[int]:
        so_req = request.structured_output_request
        # A request still reasoning has its matcher aside (waiting_grammar): the manager starts
        # it when the reasoning-end token comes, so its tokens go to the manager too.
        if so_req is None or (so_req.grammar is None and so_req.waiting_grammar is None):
            return []
        forced = self._advance(request, new_tokens) if new_tokens else []
        if so_req.grammar is not None and request.spec_token_ids and not request.is_finished():
            request.spec_token_ids = so_req.grammar.validate_tokens(request.spec_token_ids)
        return forced

    def _advance(self, request: Request, new_tokens: list[int]) -> list[int]:
        """Move the matcher over the request's new tokens; a finished grammar stops the
        request. Returns the tokens jump-forward decoding appended (the grammar forced them)."""
        mgr = self.manager
        if not mgr.accept_tokens(request, new_tokens):
            # Cannot happen with the bitmask applied; finish rather than produce invalid output.
            logger.error("Request %s: token(s) %s refused by its grammar.", request.request_id,
                         new_tokens)
            if not request.is_finished():
                request.status = RequestStatus.FINISHED_ERROR
                request.stop_reason = mgr.refusal_reason(request)
            return []
        if request.is_finished():
            return []
        if mgr.is_terminated(request):
            request.status = RequestStatus.FINISHED_STOPPED
            return []
        if not self.enable_jump_forward or request.sampling_params.logprobs is not None:
            return []
        appended = append_tokens(request, mgr.jump_forward_tokens(request), self.max_model_len)
        if appended and not request.is_finished() and mgr.is_terminated(request):
            request.status = RequestStatus.FINISHED_STOPPED
        return appended

    def request_finished(self, request: Request) -> tuple[bool, None]:
        self.waiting_for_fsm.pop(request.request_id, None)
        self.manager.drop(request)
        return False, None
