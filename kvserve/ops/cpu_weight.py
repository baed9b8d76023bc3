"""One weight object per linear / embedding / LM-head weight, in one of a few named variants.

    variant         kept                                     <= 8 rows            more rows
    plain           [N, K] in the activations' dtype         kernel / F.linear    F.linear
    prepacked       oneDNN's layout only                     oneDNN               oneDNN
    prepacked+copy  oneDNN's, and [N, K] or tiled            kernel on the copy   oneDNN
    widened         16-bit [N, K] or tiled, float32 math     kernel (widens in    prepacked float32
                    (+ optional prepacked float32 copy)      registers)           copy, else widened
                                                                                  per call

"tiled" is the small-batch kernel's layout of the weight it streams (ops.linear.tile_weight:
the same products in the same order, so the same bits, at a faster stream); a variant's
streamed weight takes it wherever the kernel has it. `choose_weight_plan` is the one policy:
from the weights' and activations' dtypes, the ISA tier, whether the small-batch kernel and
oneDNN packing exist here, and the memory budget for extra copies, the same plan for every
weight of a model. `make_weight` applies it to one weight. On CUDA every weight is plain.

A layer calls `matmul(x, bias)`; the fused small-step path (model/layers/fused_decode.py) asks
`streamed()` for the weight the small-batch kernel reads (None: prepacked only); an embedding
looks its rows up with `rows(ids)` (a tied LM head and its embedding share one object).
Quantized formats (GGUF Q4_0 / Q8_0 / Q4_K ...) are meant to be more subclasses of
CpuLinearWeight with their own matmul / streamed / rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.ops.linear import (TILE_ROWS, is_tiled, pack_weight, packed_linear,
                                small_batch_or_packed_linear, tile_weight)

PLAIN, PREPACKED, PREPACKED_WITH_COPY, WIDENED = "plain", "prepacked", "prepacked+copy", "widened"
VARIANTS = (PLAIN, PREPACKED, PREPACKED_WITH_COPY, WIDENED)

# Tiers (per weight dtype) where keeping the plain weight beside the prepacked one pays: with
# plain weights a small step runs every decoder layer in one C++ call through the small-batch
# kernel, which a prepacked-only weight cannot. Batch-1 decode of the 110M Llama, 2 threads,
# alternating runs (benchmarks/README.md, issue 16): AVX2 EPYC float32 1.15-1.75x per linear
# alone; AVX-512 Zen 4 (avx512_bf16) float32 44-46 -> 51-56 tok/s, bfloat16 72-78 -> 87-91 (and
# more tiled). A bf16 weight with bf16 math has the kernel's dpbf16 path only on avx512_bf16.
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
    """The variant for a model's matmul weights: `numel` elements of `weight_dtype` in all,
    `tied_numel` of them an LM head shared with the embedding (whose plain weight stays
    anyway); activations in `act_dtype`; `kernel`: the small-batch kernel is built (it serves
    batches of up to SMALL_BATCH_MAX_ROWS rows); `packing`: oneDNN can prepack `act_dtype`;
    `budget`: bytes extra copies may take.

    - CUDA, or no prepacking: plain.
    - 16-bit weights with float32 math (dtype "auto" without bf16 instructions): widened -- the
      weight stays 16-bit (half the bytes per decode step). Above the kernel's rows a step is
      compute-bound, and widening the whole weight per call ran prefill at 0.44x float32's
      speed, so a prepacked float32 copy (2x the 16-bit bytes) is kept where it fits.
    - Otherwise prepacked (oneDNN: 1.1-3x F.linear), plus the plain copy for small batches
      where the kernel beats it on this tier (SMALL_BATCH_COPY_TIERS) and the copy fits."""
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
    """A weight kept plain ([N, K], or tiled): the base of the variants, and "plain" itself.
    `weight` is the layer's Parameter (moved into huge pages after loading, so it is read
    through the Parameter); matmuls return x's dtype, rows() the stored one."""
    variant = PLAIN

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype,
                 packed: Optional[torch.Tensor] = None) -> None:
        self.weight = weight
        self.act_dtype = act_dtype
        self.packed = packed       # oneDNN's prepacked weight in act_dtype, if one is kept

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., K] @ weight.T (+ bias): the small-batch kernel up to SMALL_BATCH_MAX_ROWS
        rows, then the prepacked copy where there is one, else F.linear / widened_linear."""
        return small_batch_or_packed_linear(x, self.weight, self.packed, bias)

    def streamed(self) -> Optional[torch.Tensor]:
        """The weight the small-batch kernel streams for x of act_dtype (plain or tiled), which
        the fused small-step op may take; None where only a prepacked copy is kept."""
        return self.weight

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup of rows `ids` in the stored dtype (a tiled weight's too)."""
        w = self.weight
        if is_tiled(w):
            return w[ids // TILE_ROWS, :, ids % TILE_ROWS, :].reshape(*ids.shape, -1)
        return F.embedding(ids, w)

    def __repr__(self) -> str:
        w = self.weight
        return (f"{type(self).__name__}({self.variant}, {tuple(w.shape)} {w.dtype}, "
                f"act {self.act_dtype}, packed={self.packed is not None})")


class PrepackedWeight(CpuLinearWeight):
    """oneDNN's layout only; the plain weight is emptied unless a tied embedding reads it."""
    variant = PREPACKED

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return packed_linear(x, self.packed, bias)

    def streamed(self) -> Optional[torch.Tensor]:
        return None


class PrepackedWithCopy(CpuLinearWeight):
    """Prepacked for large batches, the plain (tiled) copy for the small-batch kernel."""
    variant = PREPACKED_WITH_COPY


class WidenedWeight(CpuLinearWeight):
    """A 16-bit weight with float32 activations, optionally with a prepacked float32 copy."""
    variant = WIDENED


def make_weight(weight: torch.nn.Parameter, plan: WeightPlan, act_dtype: torch.dtype,
                keep_plain: bool = False) -> CpuLinearWeight:
    """`weight`'s object under `plan` (changing the Parameter's data to the tiled layout or to
    nothing where the plan says so). keep_plain: the plain weight is read elsewhere too (a tied
    embedding's rows), so a prepacked-only weight keeps it. A weight oneDNN cannot pack stays
    plain."""
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

