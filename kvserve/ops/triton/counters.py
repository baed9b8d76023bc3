"""Arrival counters for kernels whose last program to finish a piece of work merges the
others' partial results (split-KV decode attention, the packed GEMV's K splits): int32, all 0
between launches (the merging program resets its own), one buffer per (user, device) kept
for every later launch, so a captured CUDA graph's replays find them at 0 too."""
from __future__ import annotations

from typing import Optional

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(user: str, device: torch.device, n: int,
                     at_least: int = 4096) -> Optional[torch.Tensor]:
    """`user`'s counters on `device`, at least n of them. None where a larger buffer would
    have to be made while a CUDA graph is captured (the caller then merges another way)."""
    buf = _BUFFERS.get((user, device))
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _BUFFERS[(user, device)] = torch.zeros(max(n, at_least), dtype=torch.int32,
                                                     device=device)
    return buf


def counters_at_rest(user: str, device: torch.device) -> bool:
    """Whether every counter of `user` on `device` is 0 (tests: no merge left one set)."""
    buf = _BUFFERS.get((user, device))
    return buf is None or not bool(buf.any())
