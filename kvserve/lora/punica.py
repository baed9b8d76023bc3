"""Batched LoRA for a mixed batch, punica's shrink-then-expand, grouped by slot.

Each step the runner gives every token a slot (`token_slots`, -1 = the base model, no delta).
`LoRAMapping` turns that into groups: per active slot, the tokens that use it — a slice when
they are contiguous (a request's tokens are; so are a batch's of one adapter), else an index
tensor. A layer's delta is then, per group (at most --max-loras of them, never per request):

    shrink:  s = x[g] @ A[slot]^T        [Tg, n*R]   (n = fused slices, R = max rank)
    expand:  y[g] += s @ B[slot]^T       [Tg, out]   (B block-diagonal over the slices,
                                                      the LoRA scaling folded in)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import numpy as np
import torch

Group = tuple[int, Union[slice, torch.Tensor]]


@dataclass
class LoRAMapping:
    """This step's token -> slot grouping, shared by every LoRA layer of the model."""
    groups: list[Group] = field(default_factory=list)
    num_tokens: int = 0

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """token_slots [T] int: the slot of each token of the flattened batch, -1 for base."""
        self.num_tokens = len(token_slots)
        groups: list[Group] = []
        for slot in np.unique(token_slots):
            if slot < 0:
                continue
            idx = np.flatnonzero(token_slots == slot)
            if idx[-1] - idx[0] + 1 == len(idx):
                groups.append((int(slot), slice(int(idx[0]), int(idx[-1]) + 1)))
            else:
                groups.append((int(slot), torch.from_numpy(idx).to(device)))
        self.groups = groups

    def clear(self) -> None:
        self.groups, self.num_tokens = [], 0


def add_lora(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             groups: list[Group]) -> None:
    """y[T, out] += per group: (x[g] @ a_stack[slot]^T) @ b_stack[slot]^T, in place.

    a_stack [S, n*R, in], b_stack [S, out, n*R]; groups from LoRAMapping."""
    for slot, g in groups:
        shrunk = x[g] @ a_stack[slot].t()
        delta = shrunk @ b_stack[slot].t()
        if isinstance(g, slice):
            y[g] += delta
        else:
            y.index_add_(0, g, delta)


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                       b_stack: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The same delta token by token in float64 (tests only): gathers each token's A and B."""
    mask = token_slots >= 0
    slots = token_slots.clamp(min=0)
    a = a_stack.double()[slots]                       # [T, n*R, in]
    b = b_stack.double()[slots]                       # [T, out, n*R]
    s = torch.einsum("ti,tri->tr", x.double(), a)
    d = torch.einsum("tr,tor->to", s, b) * mask[:, None]
    return y.double() + d
