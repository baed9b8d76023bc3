"""One weight object per linear / embedding / LM-head weight, in one of a few named variants.

    variant         kept                                     <= 8 rows            more rows
    plain           [N, K] in the activations' dtype         kernel / F.linear    F.linear
    prepacked       oneDNN's layout only                     oneDNN               oneDNN
    prepacked+copy  oneDNN's, and [N, K] or tiled            kernel on the copy   oneDNN
    widened         16-bit [N, K] or tiled, float32 math     kernel (widens in    prepacked float32
                    (+ optional prepacked float32 copy)      registers)           copy, else widened
                                                                                  per call

"tiled": the kernel's layout of the weight it streams (ops.linear.tile_weight; same bits, a
faster stream), taken wherever the kernel has it. `choose_weight_plan` is the one policy (one
plan per model); `make_weight` applies it to a weight. On CUDA every weight is plain.

Layers call `matmul(x, bias)`; the fused small-step op asks `streamed()` for the weight the
kernel reads (None: prepacked only); embeddings call `rows(ids)` (a tied LM head and its
embedding share one object). Quantized GGUF formats are meant to be more subclasses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.ops.linear import (SMALL_BATCH_MAX_ROWS, TILE_ROWS, is_tiled, linear, pack_weight,
                                packed_linear, tile_weight)

PLAIN, PREPACKED, PREPACKED_WITH_COPY, WIDENED = "plain", "prepacked", "prepacked+copy", "widened"
VARIANTS = (PLAIN, PREPACKED, PREPACKED_WITH_COPY, WIDENED)

# Tiers (per weight dtype) where a plain copy beside the prepacked weight pays: small steps then
# run every decoder layer in one C++ call (a prepacked-only weight cannot). Batch-1 decode, 110M
# Llama, 2 threads (benchmarks/README.md, issue 16): AVX2 EPYC float32 1.15-1.75x per linear;
# Zen 4 float32 44-46 -> 51-56 tok/s, bfloat16 72-78 -> 87-91. bf16 math: dpbf16 only.
SMALL_BATCH_COPY_TIERS = {torch.float32: ("avx2", "avx512", "avx512_bf16"),
                          torch.bfloat16: ("avx512_bf16",)}


@dataclass(frozen=True)
class WeightPlan:
    """What every weight of a model keeps (see the module docstring)."""
    variant: str = PLAIN
    float32_copy: bool = False     # widened: also a prepacked float32 copy for large batches
    tiled: bool = True             # the streamed weight in the kernel's tiled layout where it can

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"weight variant must be one of {VARIANTS}, got {self.variant!r}")


def choose_weight_plan(weight_dtype: torch.dtype, act_dtype: torch.dtype, *, device: str,
                       tier: Optional[str], kernel: bool, packing: bool, numel: int,
                       tied_numel: int, budget: int) -> WeightPlan:
    """The plan for a model's matmul weights: `numel` elements in all, `tied_numel` of them an
    LM head sharing the embedding's (kept plain anyway); `kernel`: the small-batch kernel (up
    to 8 rows) is built; `packing`: oneDNN can prepack act_dtype; `budget`: bytes for copies.
    CUDA or no prepacking: plain. 16-bit weights with float32 math: widened (half the bytes
    per decode step), plus a prepacked float32 copy where it fits (widening per call ran
    prefill at 0.44x float32's speed). Otherwise prepacked (1.1-3x F.linear), plus the plain
    copy where the kernel beats it on this tier and it fits."""
    if device != "cpu":
        return WeightPlan(PLAIN)
    if act_dtype != weight_dtype:
        return WeightPlan(WIDENED, float32_copy=packing and numel * 4 <= budget)
    if not packing:
        return WeightPlan(PLAIN)
    copy_bytes = (numel - tied_numel) * torch.finfo(weight_dtype).bits // 8
    copy = (kernel and tier in SMALL_BATCH_COPY_TIERS.get(weight_dtype, ())
            and copy_bytes <= budget)
    return WeightPlan(PREPACKED_WITH_COPY if copy else PREPACKED)


class CpuLinearWeight:
    """The base of the variants, and "plain" itself. `weight` is the layer's Parameter (read
    through it: huge pages move its data after loading)."""
    variant = PLAIN

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype,
                 packed: Optional[torch.Tensor] = None) -> None:
        self.weight = weight
        self.act_dtype = act_dtype
        self.packed = packed       # oneDNN's prepacked weight in act_dtype, if one is kept

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., K] @ weight.T (+ bias) in x's dtype: the kernel up to 8 rows, then the
        prepacked copy where there is one, else F.linear / widened_linear (ops.linear)."""
        if self.packed is not None and x.numel() > SMALL_BATCH_MAX_ROWS * x.shape[-1]:
            return packed_linear(x, self.packed, bias)
        return linear(x, self.weight, bias)

    def streamed(self) -> Optional[torch.Tensor]:
        """The weight the small-batch kernel streams for x of act_dtype (plain or tiled), the
        fused small-step op's; None where only a prepacked copy is kept."""
        return self.weight

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup of rows `ids` in the stored dtype (a tiled weight's too)."""
        w = self.weight
        if is_tiled(w):
            return w[ids // TILE_ROWS, :, ids % TILE_ROWS, :].reshape(*ids.shape, -1)
        return F.embedding(ids, w)


class PrepackedWeight(CpuLinearWeight):
    """oneDNN's layout only; the plain weight is emptied unless a tied embedding reads it."""
    variant = PREPACKED

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return packed_linear(x, self.packed, bias)

    def streamed(self) -> Optional[torch.Tensor]:
        return None


class PrepackedWithCopy(CpuLinearWeight):
    variant = PREPACKED_WITH_COPY      # the plain (tiled) copy up to 8 rows, oneDNN above


class WidenedWeight(CpuLinearWeight):
    variant = WIDENED                  # 16-bit, float32 x; `packed`: a float32 copy or None


def make_weight(weight: torch.nn.Parameter, plan: WeightPlan, act_dtype: torch.dtype,
                keep_plain: bool = False) -> CpuLinearWeight:
    """`weight`'s object under `plan` (tiling or emptying the Parameter's data as it says);
    keep_plain: a tied embedding reads the plain weight too. Unpackable weights stay plain."""
    if plan.variant == PLAIN:
        return CpuLinearWeight(weight, act_dtype)
    if plan.variant == WIDENED:
        packed = pack_weight(weight.to(act_dtype)) if plan.float32_copy else None
        _tile(weight, act_dtype, plan)
        return WidenedWeight(weight, act_dtype, packed)
    packed = pack_weight(weight)
    if packed is None:
        return CpuLinearWeight(weight, act_dtype)
    if plan.variant == PREPACKED_WITH_COPY:
        _tile(weight, act_dtype, plan)
        return PrepackedWithCopy(weight, act_dtype, packed)
    if not keep_plain:
        weight.data = torch.empty(0, dtype=weight.dtype)    # never read again
    return PrepackedWeight(weight, act_dtype, packed)


def _tile(weight: torch.nn.Parameter, act_dtype: torch.dtype, plan: WeightPlan) -> None:
    tiled = tile_weight(weight, act_dtype) if plan.tiled else None
    if tiled is not None:
        weight.data = tiled

