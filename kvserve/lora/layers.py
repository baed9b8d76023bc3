"""LoRALinear: the LoRA part of one (possibly fused, possibly TP-sharded) linear layer.

It sits on the base layer as `layer.lora` (LinearBase.apply_linear adds its delta), holding
every slot's A and B stacked: A [S, n*R, in_local], B [S, out_local, n*R], where n is the
number of checkpoint modules fused into the layer (q,k,v -> 3; gate,up -> 2; else 1) and R
is --max-lora-rank. Slice i of a fused layer takes A's rows [i*R, i*R + r) and B's block
(its output rows, columns [i*R, i*R + r)); the rest stays zero, so smaller ranks and
modules an adapter does not target add nothing.

Sharded like the base layer, through the base layer's own weight_loader: a column-parallel
layer (qkv, gate_up) keeps A whole and loads its rows of B; a row-parallel one (o, down)
loads its columns of A and keeps B whole — its partial delta is summed by the layer's
all-reduce together with the partial matmul.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from kvserve.lora.punica import LoRAMapping, add_lora
from kvserve.model.layers.linear import LinearBase, RowParallelLinear

ShardId = Optional[Union[int, str]]


class LoRALinear:
    def __init__(self, base: LinearBase, modules: list[tuple[str, ShardId]], max_loras: int,
                 max_rank: int, mapping: LoRAMapping) -> None:
        self.base = base
        self.modules = modules                  # (PEFT module name, the base's shard id)
        self.max_rank = max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.mapping = mapping
        n = len(modules)
        weight = base.weight
        self.a_stack = torch.zeros(max_loras, n * max_rank, base.input_size,
                                   dtype=weight.dtype, device=weight.device)
        self.b_stack = torch.zeros(max_loras, base.output_size, n * max_rank,
                                   dtype=weight.dtype, device=weight.device)

    def set_slot(self, slot: int,
                 weights: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Fill `slot` with one adapter: per module of `self.modules`, its full (A, scaled B)
        or None (not targeted)."""
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        for i, ((_, shard_id), ab) in enumerate(zip(self.modules, weights)):
            if ab is None:
                continue
            a, b = ab
            r, col = a.shape[0], i * self.max_rank
            a_dst = self.a_stack[slot, col:col + r]
            if self.row_parallel:      # A split by input columns, B whole
                self.base.weight_loader(a_dst, a, shard_id)
                self.b_stack[slot, :, col:col + r].copy_(b)
            else:                      # A whole, B's rows of this shard (and slice)
                a_dst.copy_(a)
                rows = torch.zeros(self.base.output_size, r, dtype=self.b_stack.dtype,
                                   device=self.b_stack.device)
                self.base.weight_loader(rows, b, shard_id)
                self.b_stack[slot, :, col:col + r].copy_(rows)

    def clear_slot(self, slot: int) -> None:
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's x @ W^T, this rank's part) plus this step's LoRA deltas."""
        groups = self.mapping.groups
        if groups and x.shape[0] == self.mapping.num_tokens:
            add_lora(y, x.reshape(-1, x.shape[-1]), self.a_stack, self.b_stack, groups)
        return y
