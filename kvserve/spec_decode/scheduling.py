"""The scheduler's hook for speculative decoding (a SchedulerHook): drafts scheduled after a
decode token, rejected ones rolled back (their KV slots are rewritten next step; only blocks
full of accepted tokens were ever cached), acceptance counted, and the adaptive rule
(adaptive.py) fed and asked who drafts next."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvserve.core.sched_hooks import SchedulerHook
from kvserve.metrics.spec_decode import SpecDecodingStats

if TYPE_CHECKING:
    from kvserve.core.request import Request
    from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
    from kvserve.spec_decode.adaptive import SpecDecodeController


class SpecDecodeScheduling(SchedulerHook):
    def __init__(self, num_spec_tokens: int, controller: "SpecDecodeController",
                 max_model_len: int) -> None:
        self.controller = controller
        self.max_model_len = max_model_len
        self.spec_decoding_stats = SpecDecodingStats(num_spec_tokens)
        self._step_start = 0.0
        self._last_update: tuple[int, float] = (-1, 0.0)   # (step_id, time) of the last update

    def draft_tokens(self, request: "Request", num_new_tokens: int, budget: int) -> list[int]:
        """The drafts that run this step: only after the request's one new (decode) token, and
        a step yields at most drafts + 1 tokens. A constrained request's drafts were cut at
        the first token its grammar refuses when they arrived."""
        drafts = request.spec_token_ids
        if (not drafts or num_new_tokens != 1
                or request.num_tokens - request.num_computed_tokens != 1):
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens - 1)
        return drafts[:max(room, 0)]

    def on_scheduled(self, output: "SchedulerOutput", requests: dict[str, "Request"]) -> None:
        drafters = self.controller.draft_req_ids(list(output.num_scheduled_tokens))
        output.spec_decode_draft_req_ids = drafters
        output.spec_decode_num_draft_tokens = self.controller.num_draft_tokens(
            len(output.num_scheduled_tokens), drafters)
        self._step_start = time.perf_counter()

    def update_from_output(self, so: "SchedulerOutput", runner_output: "ModelRunnerOutput") -> None:
        """Feed the adaptive rule the cost of an all-decode step: the engine loop's period
        since the previous step's update (what drafting adds outside schedule -> update, such
        as the draft positions' grammar bitmask, included), else schedule -> update."""
        now = time.perf_counter()
        last_id, last_time = self._last_update
        self._last_update = (so.step_id, now)
        step_time = now - (last_time if last_id == so.step_id - 1 else self._step_start)
        spec = so.scheduled_spec_decode_tokens
        if so.is_empty or any(n != 1 + len(spec.get(rid, ()))
                              for rid, n in so.num_scheduled_tokens.items()):
            return   # a prefill chunk in the step: not a decode step's cost
        proposed = sum(map(len, runner_output.spec_token_ids or ()))
        drafters = so.spec_decode_draft_req_ids or set()
        self.controller.observe_step(
            len(so.num_scheduled_tokens), sum(map(len, spec.values())), proposed, step_time,
            runner_output.spec_propose_time, num_resumed=len(drafters.difference(spec)))

    def update_request(self, request: "Request", idx: int, new_tokens: list[int],
                       so: "SchedulerOutput", runner_output: "ModelRunnerOutput") -> list[int]:
        drafts = so.scheduled_spec_decode_tokens.get(request.request_id)
        if drafts:
            num_accepted = max(len(runner_output.sampled_token_ids[idx]) - 1, 0)
            request.num_computed_tokens -= len(drafts) - num_accepted
            self.spec_decoding_stats.observe(len(drafts), num_accepted)
            self.controller.record(request.request_id, len(drafts), num_accepted)
        if runner_output.spec_token_ids and not request.is_finished():
            request.spec_token_ids = runner_output.spec_token_ids[idx]
        return []

    def request_finished(self, request: "Request") -> tuple[bool, None]:
        self.controller.drop(request.request_id)
        return False, None

    def stats(self) -> dict[str, Any]:
        return {"spec_decoding": self.spec_decoding_stats.to_dict()}
