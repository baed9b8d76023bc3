"""Executor: owns the workers and runs methods on them (`collective_rpc`)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Optional, Union

from kvserve.config import KVServeConfig
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: KVServeConfig) -> None:
        self.config = config
        self._init_executor()

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

    @property
    def output_rank(self) -> int:
        """The rank whose execute_model reply carries the output: the first TP rank of the
        last pipeline stage (rank 0 without PP)."""
        pc = self.config.parallel_config
        return pc.world_size - pc.tensor_parallel_size

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine core may keep in flight: one per pipeline stage (the batch
        queue), when the executor can run them without blocking."""
        return self.config.parallel_config.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> Union[ModelRunnerOutput, "Future[ModelRunnerOutput]"]:
        """Run one step; with `non_block`, a Future of its output comes back at once."""
        if non_block:
            future: Future = Future()
            try:
                future.set_result(self.execute_model(scheduler_output))
            except Exception as e:
                future.set_exception(e)
            return future
        return self.collective_rpc("execute_model", (scheduler_output,),
                                   unique_reply_rank=self.output_rank)[0]

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        pass
