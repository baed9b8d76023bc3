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

LoRAEmbedding and LoRALogits do the same for the token embedding and the LM head (vLLM's
VocabParallelEmbeddingWithLoRA / LogitsProcessorWithLoRA): the embedding's shrink is a
lookup of the token ids in A^T [vocab, R] (whole on every rank: the base lookup is
all-reduced first, so the delta is added to the full row), then the expand by B [H, R]; the
LM head's delta is computed on the rows being scored only (this rank's vocab rows of B).

Every layer skips the slots whose adapter does not target it (`has`), so an adapter on the
attention projections only costs nothing in the MLP, embedding or LM head.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from kvserve.lora.punica import LoRAMapping, add_lora
from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers.linear import (LinearBase, MergedColumnParallelLinear,
                                         QKVParallelLinear, RowParallelLinear)
from kvserve.ops import lora as cpu_lora

ShardId = Optional[Union[int, str]]


@dataclass
class SortedTokens:
    """This step's adapter tokens ordered slot by slot, set by the manager once per step when
    some adapter's tokens are not contiguous (interleaved requests; not on CUDA, where the
    Triton kernels group them on the device): a layer then gathers x
    once, runs contiguous groups, and scatters once — not a gather and an index_add_ per
    adapter (each a parallel region: costly on a busy CPU)."""
    perm: Optional[torch.Tensor] = None          # adapter token indices, slot by slot
    groups: list = field(default_factory=list)   # (slot, slice into perm)

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        idx = np.flatnonzero(token_slots >= 0)
        order = idx[np.argsort(token_slots[idx], kind="stable")]
        slots, starts, counts = np.unique(token_slots[order], return_index=True,
                                          return_counts=True)
        self.perm = torch.from_numpy(order).to(device)
        self.groups = [(int(s), slice(int(a), int(a + c))) for s, a, c in zip(slots, starts, counts)]

    def clear(self) -> None:
        self.perm, self.groups = None, []


def b_stack_zeros(slots: int, out: int, rank: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A zero B stack [slots, out, rank] stored column-major per slot (a transposed view of
    [slots, rank, out]): the C++ kernel's expand then reads each rank column as a run of
    outputs (an axpy over the rank, no horizontal sums); torch's matmul and the Triton kernels
    take it by its strides. Allocated once: loading an adapter copies into its slot."""
    return torch.zeros(slots, rank, out, dtype=dtype, device=device).transpose(1, 2)


class _SlotStacks:
    """What every LoRA layer kind holds per adapter slot: the A / B stacks (zero where the slot
    is empty) and `has[slot]`, whether the slot's adapter targets this layer."""
    a_stack: torch.Tensor
    b_stack: torch.Tensor
    has: list[bool]

    def clear_slot(self, slot: int) -> None:
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        self.has[slot] = False


class LoRALinear(_SlotStacks):
    def __init__(self, base: LinearBase, modules: list[tuple[str, ShardId]], max_loras: int,
                 max_rank: int, mapping: LoRAMapping,
                 sorted_tokens: Optional[SortedTokens] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        self.base = base
        self.sorted_tokens = sorted_tokens
        self.modules = modules                  # (PEFT module name, the base's shard id)
        self.max_rank = max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.mapping = mapping
        n = len(modules)
        weight = base.weight
        dtype = dtype or weight.dtype           # --lora-dtype (lora/config.py stack_dtype)
        self.a_stack = torch.zeros(max_loras, n * max_rank, base.input_size,
                                   dtype=dtype, device=weight.device)
        self.b_stack = b_stack_zeros(max_loras, base.output_size, n * max_rank, dtype,
                                     weight.device)
        self.out_splits = _out_splits(base, n)
        self.has = [False] * max_loras          # slot -> its adapter targets this layer
        # The same as a tensor, kept in step: the fused small-step C++ op reads it.
        self.has_mask = torch.zeros(max_loras, dtype=torch.bool)

    def set_slot(self, slot: int,
                 weights: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Fill `slot` with one adapter: per module of `self.modules`, its full (A, scaled B)
        or None (not targeted)."""
        self.clear_slot(slot)
        self.has[slot] = any(ab is not None for ab in weights)
        self.has_mask[slot] = self.has[slot]
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
        super().clear_slot(slot)
        self.has_mask[slot] = False

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's x @ W^T, this rank's part) plus this step's LoRA deltas."""
        if self.mapping.static:     # CUDA-graph mode: every slot, whatever adapter it holds
            if x.shape[0] == self.mapping.num_tokens:
                add_lora(y, x.reshape(-1, x.shape[-1]), self.a_stack, self.b_stack,
                         self.mapping.groups, self.out_splits)
            return y
        groups = _targeting(self.mapping.groups, self.has)
        if not groups or x.shape[0] != self.mapping.num_tokens:
            return y
        x = x.reshape(-1, x.shape[-1])
        st = self.sorted_tokens
        if st is None or st.perm is None or _kernel_groups_tokens(x):
            add_lora(y, x, self.a_stack, self.b_stack, groups, self.out_splits)
            return y
        xs = x[st.perm]
        ys = torch.zeros(xs.shape[0], y.shape[-1], dtype=y.dtype, device=y.device)
        add_lora(ys, xs, self.a_stack, self.b_stack, _targeting(st.groups, self.has),
                 self.out_splits)
        return y.index_put_((st.perm,), ys, accumulate=True)


def _out_splits(base: LinearBase, n: int) -> tuple[int, ...]:
    """This rank's output rows of each of the n fused slices, in the order set_slot fills B
    (its block-diagonal layout, which the C++ kernel's expand exploits); () for one slice."""
    if n <= 1:
        return ()
    if isinstance(base, QKVParallelLinear):
        splits = (base.q_size, base.kv_size, base.kv_size)
    elif isinstance(base, MergedColumnParallelLinear):
        splits = tuple(size // base.tp_size for size in base.output_sizes)
    else:
        return ()
    return splits if len(splits) == n and sum(splits) == base.output_size else ()


def _kernel_groups_tokens(x: torch.Tensor) -> bool:
    """The C++ kernel will take x's tokens and groups interleaved ones itself, so no gather /
    scatter around it (what the fused small-step op does too)."""
    return (x.device.type == "cpu" and x.shape[0] <= cpu_lora.CPU_KERNEL_MAX_TOKENS
            and cpu_lora.kernel_enabled())


def _targeting(groups: list, has: list[bool]) -> list:
    """The groups whose slot's adapter targets the layer."""
    return [gr for gr in groups if has[gr[0]]] if groups else groups


@dataclass
class LogitsRows:
    """Which of this step's tokens the next compute_logits call scores: the runner sets
    `rows` (token indices into the step's flattened batch) before each call; LoRALogits
    reads each row's slot from `token_slots` (the step's per-token slots, -1 = base)."""
    token_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    rows: Optional[np.ndarray] = None

    def take(self, num_rows: int) -> np.ndarray:
        """The slots of the `num_rows` rows being scored (the rows are then used up)."""
        rows, self.rows = self.rows, None
        if rows is None:
            if num_rows != len(self.token_slots):
                raise RuntimeError(f"LoRA on lm_head: {num_rows} rows to score but no token "
                                   f"indices were given for them (the model runner sets "
                                   f"them before compute_logits).")
            return self.token_slots
        if len(rows) != num_rows:
            raise RuntimeError(f"LoRA on lm_head: {num_rows} rows to score, {len(rows)} token "
                               f"indices given.")
        return self.token_slots[rows]


class LoRAEmbedding(_SlotStacks):
    """LoRA of the token embedding: A^T [S, vocab, R] read as a lookup table, B [S, H, R]."""
    modules: list[tuple[str, ShardId]] = [("embed_tokens", None)]

    def __init__(self, base: VocabParallelEmbedding, max_loras: int, max_rank: int,
                 mapping: LoRAMapping, dtype: torch.dtype) -> None:
        self.base = base
        self.mapping = mapping
        device = base.weight.device
        self.a_stack = torch.zeros(max_loras, base.num_embeddings, max_rank, dtype=dtype,
                                   device=device)
        self.b_stack = torch.zeros(max_loras, base.embedding_dim, max_rank, dtype=dtype,
                                   device=device)
        self.has = [False] * max_loras

    def set_slot(self, slot: int,
                 weights: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """weights: [(PEFT's lora_embedding_A [r, vocab], scaled lora_embedding_B [H, r])]
        or [None]."""
        self.clear_slot(slot)
        if weights[0] is None:
            return
        a, b = weights[0]
        r = a.shape[0]
        self.a_stack[slot, :, :r].copy_(a.t())
        self.b_stack[slot, :, :r].copy_(b)
        self.has[slot] = True

    def apply(self, input_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, H] (the base lookup, all ranks' rows) plus each token's adapter delta."""
        if self.mapping.static:
            return self._apply_static(input_ids, out)
        groups = _targeting(self.mapping.groups, self.has)
        if not groups or input_ids.shape[0] != self.mapping.num_tokens:
            return out
        for slot, g in groups:           # at most --max-loras groups, never per request
            delta = (self.a_stack[slot][input_ids[g]] @ self.b_stack[slot].t()).to(out.dtype)
            if isinstance(g, slice):
                out[g] += delta
            else:
                out.index_add_(0, g, delta)
        return out


    def _apply_static(self, input_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """apply in CUDA-graph mode: the lookup of every token in its slot's A^T (slot -1 reads
        slot 0's row, then masked), one masked expand per slot: shapes only, no host reads."""
        slots = self.mapping.groups.token_slots
        if input_ids.shape[0] != slots.shape[0]:
            return out
        shrunk = self.a_stack[slots.clamp(min=0), input_ids]            # [T, R]
        zero = torch.zeros((), dtype=out.dtype, device=out.device)
        for slot in range(self.a_stack.shape[0]):
            delta = (shrunk @ self.b_stack[slot].t()).to(out.dtype)
            out.add_(torch.where((slots == slot)[:, None], delta, zero))
        return out


class LoRALogits(_SlotStacks):
    """LoRA of the LM head: A [S, R, H] whole, B [S, vocab_shard, R] (this rank's vocab rows,
    padding rows zero), applied to the scored rows before the logits' all-gather."""
    modules: list[tuple[str, ShardId]] = [("lm_head", None)]

    def __init__(self, base: ParallelLMHead, max_loras: int, max_rank: int,
                 rows: LogitsRows, dtype: torch.dtype) -> None:
        self.base = base
        self.rows = rows
        device = base.weight.device
        self.a_stack = torch.zeros(max_loras, max_rank, base.embedding_dim, dtype=dtype,
                                   device=device)
        self.b_stack = b_stack_zeros(max_loras, base.shard_size, max_rank, dtype, device)
        self.has = [False] * max_loras

    def set_slot(self, slot: int,
                 weights: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """weights: [(A [r, H], scaled B [vocab, r])] or [None]."""
        self.clear_slot(slot)
        if weights[0] is None:
            return
        a, b = weights[0]
        r, start, end = a.shape[0], self.base.vocab_start, self.base.vocab_end
        self.a_stack[slot, :r].copy_(a)
        self.b_stack[slot, :end - start, :r].copy_(b[start:end])
        self.has[slot] = True

    def apply(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, vocab_shard] of hidden [N, H] plus each row's adapter delta."""
        if not any(self.has):
            self.rows.rows = None
            return logits
        slots = self.rows.take(hidden.shape[0])
        if not (slots >= 0).any():
            return logits
        grouping = LoRAMapping()
        grouping.set(slots, logits.device)
        groups = _targeting(grouping.groups, self.has)
        if not groups:
            return logits
        if logits.dtype == self.a_stack.dtype and hidden.dtype == logits.dtype:
            add_lora(logits, hidden, self.a_stack, self.b_stack, groups)
            return logits
        delta = torch.zeros(logits.shape, dtype=self.a_stack.dtype, device=logits.device)
        add_lora(delta, hidden.to(self.a_stack.dtype), self.a_stack, self.b_stack, groups)
        return logits + delta.to(logits.dtype)
