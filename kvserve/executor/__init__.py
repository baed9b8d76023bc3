"""Executors: base.py and its subclasses; `get_executor_class` picks one here, so that the
base imports none of them (each is imported only when chosen)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.config import KVServeConfig
    from kvserve.executor.base import Executor


def get_executor_class(config: "KVServeConfig") -> type["Executor"]:
    """The executor of config.parallel_config.distributed_executor_backend (vLLM's
    Executor.get_class): uni, mp or ray; None: mp for several workers, else uni."""
    backend = config.parallel_config.distributed_executor_backend
    if backend is None:
        backend = "mp" if config.parallel_config.world_size > 1 else "uni"
    if backend == "uni":
        from kvserve.executor.uniproc import UniProcExecutor
        return UniProcExecutor
    if backend == "mp":
        from kvserve.executor.multiproc import MultiprocExecutor
        return MultiprocExecutor
    if backend == "ray":
        from kvserve.executor.ray_executor import RayDistributedExecutor
        return RayDistributedExecutor
    raise ValueError(f"Unknown distributed_executor_backend {backend!r}; supported: uni, mp, ray.")
