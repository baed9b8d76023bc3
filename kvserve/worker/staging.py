"""Host arrays to the device without a sync: packed into one pinned buffer, one copy.

A copy from pageable memory makes the host wait for the stream (the step before); from pinned
memory with non_blocking it is queued like a kernel, which is what lets the host prepare step
N+1 while step N runs (async scheduling). The pinned buffers are used in turn: a buffer is
written again only after the step that copied from it has finished (the ring holds more
buffers than two steps' uploads, and a step's sampled ids are read before the step after next
is prepared). On CPU `upload` returns tensors over the arrays themselves (no copy).
"""
from __future__ import annotations

import numpy as np
import torch

_RING = 8             # > 2 steps in flight x 3 uploads a step
_MIN_ELEMS = 1 << 14


class PinnedStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ring: list[torch.Tensor] = []
        self._next = 0

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """int64 device tensors of `arrays`, through one pinned buffer and one copy on CUDA."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        sizes = [int(a.size) for a in arrays]
        total = sum(sizes)
        i = self._next
        self._next = (i + 1) % _RING
        if len(self._ring) < _RING:
            self._ring.append(torch.empty(0, dtype=torch.int64))
        buf = self._ring[i]
        if buf.numel() < total:
            buf = self._ring[i] = torch.empty(max(total, _MIN_ELEMS), dtype=torch.int64,
                                              pin_memory=True)
        host = buf.numpy()
        offsets = np.cumsum([0] + sizes)
        for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:]):
            host[lo:hi] = a.reshape(-1)
        dev = buf[:total].to(self.device, non_blocking=True)
        return [dev[lo:hi].view(a.shape) for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:])]
