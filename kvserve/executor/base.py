"""Executor: owns the workers and runs methods on them (`collective_rpc`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

from kvserve.config import KVServeConfig
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: KVServeConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: KVServeConfig) -> type["Executor"]:
        backend = config.parallel_config.distributed_executor_backend
        if backend is None:
            backend = "mp" if config.parallel_config.world_size > 1 else "uni"
        if backend == "uni":
            from kvserve.executor.uniproc import UniProcExecutor
            return UniProcExecutor
        if backend == "mp":
            from kvserve.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        raise ValueError(f"Unknown distributed_executor_backend {backend!r}; supported: uni, mp.")

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None,
                       unique_reply_rank: Optional[int] = None,
                       timeout: Optional[float] = None) -> list[Any]:
        """Run `method` on every worker; the replies of all ranks, or of `unique_reply_rank`."""

    def initialize_kv_cache(self) -> int:
        """Size the KV cache (the smallest any rank can hold) and allocate it on every rank."""
        num_blocks = min(self.collective_rpc("determine_num_kv_blocks"))
        self.collective_rpc("initialize_cache", (num_blocks,))
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=0)[0]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        pass
