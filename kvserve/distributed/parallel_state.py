"""Tensor-parallel group state.

One small object (`_TP_STATE`) records this process's rank in the tensor-parallel group.
Before `init_distributed` (or after `destroy_distributed`) the process is rank 0 of a group of
one and every collective is a no-op, so the same layers run unchanged with and without TP.
Pipeline parallelism is not supported, so the TP group is the whole world.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class _TensorParallelState:
    rank: int = 0
    world_size: int = 1
    group: Optional[dist.ProcessGroup] = None   # None until init_distributed
    initialized: bool = False


_TP_STATE = _TensorParallelState()


def init_distributed(rank: int, world_size: int, init_method: str, backend: str) -> None:
    """Join the process group (`backend`: "gloo" on CPU, "nccl" on CUDA) and make it the TP group.

    `init_method` is a torch.distributed URL ("tcp://host:port" or "file:///path"); each engine
    picks its own, so two engines on one machine never collide.
    """
    if _TP_STATE.initialized:
        raise RuntimeError(f"Distributed state is already initialised (rank {_TP_STATE.rank} of "
                           f"{_TP_STATE.world_size}); call destroy_distributed() first.")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}.")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method,
                                rank=rank, world_size=world_size)
    elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} "
                           f"of {dist.get_world_size()}, not rank {rank} of {world_size}.")
    _TP_STATE.rank, _TP_STATE.world_size = rank, world_size
    _TP_STATE.group, _TP_STATE.initialized = dist.group.WORLD, True


def destroy_distributed() -> None:
    """Leave the process group and return to the single-process state."""
    if _TP_STATE.initialized and dist.is_initialized():
        dist.destroy_process_group()
    _TP_STATE.rank, _TP_STATE.world_size = 0, 1
    _TP_STATE.group, _TP_STATE.initialized = None, False


def is_distributed_initialized() -> bool:
    return _TP_STATE.initialized


def get_tp_rank() -> int:
    return _TP_STATE.rank


def get_tp_world_size() -> int:
    return _TP_STATE.world_size


def get_tp_group() -> Optional[dist.ProcessGroup]:
    return _TP_STATE.group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group (in place; returns it). No-op with one rank."""
    if _TP_STATE.world_size == 1:
        return x
    dist.all_reduce(x, group=_TP_STATE.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order. No-op with one rank."""
    world_size = _TP_STATE.world_size
    if world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=_TP_STATE.group)
    return torch.cat(parts, dim=dim)
