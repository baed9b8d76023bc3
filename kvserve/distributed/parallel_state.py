"""Tensor- and pipeline-parallel group state.

Two small objects record this process's place: `_TP_STATE` (its rank in the tensor-parallel
group) and `_PP_STATE` (its pipeline stage). Before `init_distributed` (or after
`destroy_distributed`) the process is rank 0 of groups of one and every collective is a
no-op, so the same layers run unchanged with and without TP / PP.

Rank layout (vLLM's): global rank = pp_rank * tp_size + tp_rank. The TP group of a stage is
its tp_size consecutive ranks; the next stage's peer of a rank is rank + tp_size.

    tp=2, pp=2:   stage 0: ranks 0 1   ──send/recv──►   stage 1: ranks 2 3
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
    # --enable-expert-parallel: the MoE layers' expert-parallel group is this TP group (each
    # rank holds whole experts instead of a slice of every expert); off: EP rank 0 of 1.
    expert_parallel: bool = False


_TP_STATE = _TensorParallelState()


@dataclass
class _PipelineParallelState:
    rank: int = 0          # this process's stage
    world_size: int = 1    # number of stages
    tp_size: int = 1       # global-rank distance between a rank and its peer in the next stage
    global_rank: int = 0


_PP_STATE = _PipelineParallelState()


def init_distributed(rank: int, world_size: int, init_method: str, backend: str,
                     tensor_parallel_size: Optional[int] = None,
                     enable_expert_parallel: bool = False) -> None:
    """Join the process group (`backend`: "gloo" on CPU, "nccl" on CUDA) and make the TP and
    PP groups: `tensor_parallel_size` ranks per stage (default: all of them, one stage).

    `init_method` is a torch.distributed URL ("tcp://host:port" or "file:///path"); each engine
    picks its own, so two engines on one machine never collide.
    """
    tp = world_size if tensor_parallel_size is None else tensor_parallel_size
    if tp < 1 or world_size % tp:
        raise ValueError(f"world_size {world_size} is not a multiple of tensor_parallel_size {tp}.")
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
    pp = world_size // tp
    if pp == 1:
        group: Optional[dist.ProcessGroup] = dist.group.WORLD
    else:
        # new_group is collective: every rank creates every stage's group, in the same order.
        group = None
        for stage in range(pp):
            g = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == rank // tp:
                group = g
    _TP_STATE.rank, _TP_STATE.world_size = rank % tp, tp
    _TP_STATE.group, _TP_STATE.initialized = group, True
    _PP_STATE.rank, _PP_STATE.world_size = rank // tp, pp
    _PP_STATE.tp_size, _PP_STATE.global_rank = tp, rank
    _TP_STATE.expert_parallel = enable_expert_parallel


def destroy_distributed() -> None:
    """Leave the process group and return to the single-process state."""
    if _TP_STATE.initialized and dist.is_initialized():
        dist.destroy_process_group()
    _TP_STATE.rank, _TP_STATE.world_size = 0, 1
    _TP_STATE.group, _TP_STATE.initialized = None, False
    _PP_STATE.rank, _PP_STATE.world_size, _PP_STATE.tp_size, _PP_STATE.global_rank = 0, 1, 1, 0
    _TP_STATE.expert_parallel = False


def get_tp_rank() -> int:
    return _TP_STATE.rank


def get_tp_world_size() -> int:
    return _TP_STATE.world_size


def get_ep_rank() -> int:
    """This rank's place among the expert-parallel ranks (the TP group's ranks, with
    --enable-expert-parallel); 0 without expert parallelism."""
    return _TP_STATE.rank if _TP_STATE.expert_parallel else 0


def get_ep_world_size() -> int:
    return _TP_STATE.world_size if _TP_STATE.expert_parallel else 1


def get_pp_rank() -> int:
    return _PP_STATE.rank


def get_pp_world_size() -> int:
    return _PP_STATE.world_size


def is_first_pp_rank() -> bool:
    return _PP_STATE.rank == 0


def is_last_pp_rank() -> bool:
    return _PP_STATE.rank == _PP_STATE.world_size - 1


def pp_send(x: torch.Tensor) -> None:
    """Send `x` to this rank's peer in the next stage (blocking)."""
    dist.send(x.contiguous(), dst=_PP_STATE.global_rank + _PP_STATE.tp_size)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Receive a tensor of `shape` from this rank's peer in the previous stage."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=_PP_STATE.global_rank - _PP_STATE.tp_size)
    return x


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
