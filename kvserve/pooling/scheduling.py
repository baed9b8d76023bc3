"""PoolingScheduling: a pooling request finishes as soon as its prompt has been pooled.

The scheduler runs pooling requests like any prefill (chunked where the budget says); the
worker's Pooler returns a vector in the step that computes the prompt's last token, and this
hook ends the request there, so the scheduler frees its KV blocks at once (no decode, no KV
kept). The pooled vector travels to the frontend in EngineCoreOutput.pooling_output.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched_hooks import SchedulerHook

if TYPE_CHECKING:
    from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


class PoolingScheduling(SchedulerHook):
    def update_request(self, request: Request, idx: int, new_tokens: list[int],
                       scheduler_output: "SchedulerOutput",
                       runner_output: "ModelRunnerOutput") -> list[int]:
        pooled = runner_output.pooler_output
        if pooled is not None and pooled[idx] is not None:
            request.status = RequestStatus.FINISHED_STOPPED
        return []
