"""SchedulerHook: how a feature takes part in scheduling without the Scheduler knowing it.

Structured outputs, speculative decoding and KV transfer each bring one hook, living with the
feature (`<feature>/scheduling.py`); the engine core builds them and the Scheduler calls every
hook, in order, at the points below (a request's life: add_request, take_ready, admit,
draft_tokens, on_scheduled, update_from_output, update_request, request_finished). Each
default does nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from kvserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.core.kv_cache_manager import KVCacheManager
    from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


class SchedulerHook:
    # Requests from take_ready go to the front of the waiting queue (they were admitted once
    # already); otherwise they queue by the scheduling policy.
    ready_to_front = False

    def bind(self, kv_cache_manager: "KVCacheManager") -> None:
        """The scheduler's KV cache manager, handed over when the scheduler is built."""
        self.kv_cache_manager = kv_cache_manager

    def add_request(self, request: Request) -> bool:
        """True: the hook holds the request (not schedulable) until take_ready returns it."""
        return False

    def take_ready(self) -> list[Request]:
        """Held requests that may be scheduled now (status WAITING) or that failed (status
        finished: the scheduler reports them with the next outputs)."""
        return []

    def admissible(self, request: Request, running: list[Request]) -> bool:
        """False: the waiting request cannot join `running` now (LoRA: too many distinct
        adapters); the scheduler skips it this step and tries the requests behind it."""
        return True

    def admit(self, request: Request, computed_blocks: list, num_computed: int) -> bool:
        """A waiting request with `num_computed` tokens in the local prefix cache is next in
        line. True: the hook took it (the scheduler pops it from the queue)."""
        return False

    def draft_tokens(self, request: Request, num_new_tokens: int, budget: int) -> list[int]:
        """Tokens to run after the request's `num_new_tokens` this step, within `budget`."""
        return []

    def on_scheduled(self, output: "SchedulerOutput", requests: dict[str, Request]) -> None:
        """The step's output is built and the requests' progress advanced."""

    def update_from_output(self, scheduler_output: "SchedulerOutput",
                           runner_output: "ModelRunnerOutput") -> None:
        """A step's output is in (before the per-request updates)."""

    def update_request(self, request: Request, idx: int, new_tokens: list[int],
                       scheduler_output: "SchedulerOutput",
                       runner_output: "ModelRunnerOutput") -> list[int]:
        """The request (row `idx` of runner_output) kept `new_tokens` of what it sampled.
        Returns the tokens the hook appended to it."""
        return []

    def request_finished(self, request: Request) -> tuple[bool, Optional[dict[str, Any]]]:
        """The request leaves (finished or aborted, held or not). Returns (keep its KV blocks:
        the hook frees them later, kv_transfer_params for the client)."""
        return False, None

    @property
    def has_pending(self) -> bool:
        """Work left without any request (blocks waiting for a transfer)."""
        return False

    @property
    def num_waiting(self) -> int:
        """Held requests counted as waiting in the stats."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Cumulative counters, merged into the scheduler's stats."""
        return {}


def overriding(hooks: list[SchedulerHook], method: str) -> list[SchedulerHook]:
    """The hooks, in order, whose class overrides SchedulerHook's no-op `method`."""
    base = getattr(SchedulerHook, method)
    return [hook for hook in hooks if getattr(type(hook), method) is not base]


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last token ends it (vLLM's order of checks)."""
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last in request.eos_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.stop_token_ids and last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    return False


def append_tokens(request: Request, tokens: list[int], max_model_len: int) -> list[int]:
    """Append `tokens` one by one until one ends the request; returns those appended."""
    appended: list[int] = []
    for token in tokens:
        request.append_output_token_ids([token])
        appended.append(token)
        if check_stop(request, max_model_len):
            break
    return appended
