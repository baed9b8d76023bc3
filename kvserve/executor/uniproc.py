"""UniProcExecutor: one worker in this process; RPC is a method call."""
from __future__ import annotations

from typing import Any, Optional

from kvserve.executor.base import Executor
from kvserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = Worker(self.config, local_rank=0, rank=0)
        self.worker.keep_async_output = True
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None,
                       unique_reply_rank: Optional[int] = None,
                       timeout: Optional[float] = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.worker.shutdown()
