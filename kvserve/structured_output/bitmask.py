"""Applying the batch's grammar bitmask to the logits: one vectorised unpack + masked_fill.

Pure torch (no xgrammar on the workers), the same on CPU and CUDA. Bit i of int32 word w in a
row allows token 32*w + i; tokens beyond the bitmask's width are not allowed.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    t = _SHIFTS.get(device)
    if t is None:
        t = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return t


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [N, W] -> bool [N, vocab_size], True where the token is allowed."""
    n, words = bitmask.shape
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1      # [N, W, 32]
    allowed = bits.view(n, words * 32).bool()
    if words * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(n, vocab_size - words * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: Optional[np.ndarray],
                          rows: Optional[np.ndarray]) -> torch.Tensor:
    """Set the disallowed tokens of `logits[rows[i]]` to -inf using `bitmask[i]`; other rows
    are untouched. Returns a new tensor (the caller's logits are not modified)."""
    if bitmask is None or rows is None or len(rows) == 0:
        return logits
    device = logits.device
    mask = torch.from_numpy(bitmask).to(device, non_blocking=True)
    allowed = unpack_bitmask(mask, logits.shape[-1])
    idx = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(device, non_blocking=True)
    out = logits.clone()
    out[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return out
