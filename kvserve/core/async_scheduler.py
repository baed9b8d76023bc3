"""AsyncScheduler: schedules step N+1 before step N's output is in (vLLM's AsyncScheduler).

The engine core keeps one step in flight while it schedules the next. A request whose step N
samples a token holds one *placeholder* for it: the scheduler counts the token as present
(`num_tokens + num_output_placeholders`) and schedules its next decode position; the worker
fills the placeholder's input id on the device from step N's sampled ids. When step N's
output arrives the token replaces the placeholder.

    step N   scheduled ─► running ────────────► output read, tokens appended (placeholder - 1)
    step N+1            scheduled (placeholder) ─► running ─► output read ...

What stays exact, and how:
- a request that step N finishes (EOS, stop token, stop string, abort) gets one extra decode
  in step N+1 whose token is dropped (the request is gone when that output is read); a
  finish by length is known at scheduling time, so no extra step is scheduled for it;
- structured output requests wait for their in-flight step (the grammar must accept the
  token before the next bitmask is built);
- preemption may pick a request in flight (one stage, one stream: its KV writes come before
  any later step's); its in-flight output is dropped and the request recomputes.
Speculative decoding and pipeline parallelism are refused at start (arg_utils).
"""
from __future__ import annotations

from typing import Optional

from kvserve.core.messages import EngineCoreOutput
from kvserve.core.request import Request
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):

    def schedule(self) -> SchedulerOutput:
        output = super().schedule()
        for rid in output.num_scheduled_tokens:
            request = self.requests[rid]
            # This step computes the request's last known (or placeholder) token: it samples
            # (a pooling request ends with its prompt instead).
            if (request.pooling_params is None and request.num_computed_tokens
                    == request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1
        return output

    def _may_schedule(self, request: Request) -> bool:
        if request.num_output_placeholders == 0:
            return True
        if request.use_structured_output:
            return False
        # The step in flight ends it by length: no step after it.
        pending = request.num_output_placeholders
        return (request.num_output_tokens + pending < request.max_tokens
                and request.num_tokens + pending < self.max_model_len)

    def _pick_victim(self, request: Request) -> Request:
        # One stage, one stream: a request in flight may give up its blocks, as the step that
        # writes them runs before any step that reuses them.
        if self.config.policy == "priority":
            return max(self.running)
        return self.running[-1]

    def _update_request(self, request: Request, idx: int, scheduler_output: SchedulerOutput,
                        runner_output: ModelRunnerOutput) -> Optional[EngineCoreOutput]:
        if runner_output.sampled_token_ids[idx]:
            request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
        return super()._update_request(request, idx, scheduler_output, runner_output)

