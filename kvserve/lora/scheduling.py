"""LoRAScheduling: the scheduler hook of multi-LoRA.

- add_request: the request's adapter is loaded now, by a worker RPC (`add_lora`), so that the
  steps never read an adapter from disk; a failed load fails the request (reported with the
  next outputs), the engine keeps serving.
- admissible: a waiting request whose adapter would make more than --max-loras distinct
  adapters among the running requests waits (others behind it may go first), so every step's
  adapters fit the workers' slots.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched_hooks import SchedulerHook
from kvserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAScheduling(SchedulerHook):
    def __init__(self, max_loras: int, load_adapter: Callable[[LoRARequest], object]) -> None:
        self.max_loras = max_loras
        self._load_adapter = load_adapter
        self._failed: list[Request] = []

    def add_request(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None:
            return False
        try:
            self._load_adapter(lora)
        except Exception as e:   # a bad or vanished adapter fails this request only
            logger.error("Request %s: loading LoRA adapter %r failed: %s", request.request_id,
                         lora.lora_name, e)
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = f"LoRA adapter {lora.lora_name!r}: {e}"
            self._failed.append(request)
            return True
        return False

    def take_ready(self) -> list[Request]:
        failed, self._failed = self._failed, []
        return failed

    def admissible(self, request: Request, running: Sequence[Request]) -> bool:
        lora = request.lora_request
        if lora is None:
            return True
        active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        return lora.lora_int_id in active or len(active) < self.max_loras
