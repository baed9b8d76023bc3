"""One weight object per linear / embedding / LM-head weight, in one of a few named variants.

    variant         kept                                     <= 8 rows (float32   more rows
                                                             x: <= 16)
    plain           [N, K] in the activations' dtype         kernel / F.linear    F.linear
    prepacked       oneDNN's layout only                     oneDNN               oneDNN
    prepacked+copy  oneDNN's, and [N, K] or tiled            kernel on the copy   oneDNN
    widened         16-bit [N, K] or tiled, float32 math     kernel (widens in    prepacked float32
                    (+ optional prepacked float32 copy)      registers)           copy, else widened
                                                                                  per call
    quantized       GGUF blocks (ops.quant), 8 rows          int8 kernel          int8 kernel
                    interleaved; float parts beside

prepacked+copy hands float32 x to oneDNN from 7 rows on the AVX-512 tiers, where its GEMM
overtakes the kernel (ops.linear.onednn_above_rows); the fused small-step op does the same.

"tiled": the kernel's layout of the weight it streams (ops.linear.tile_weight; same bits, a
faster stream), taken wherever the kernel has it. `choose_weight_plan` is the one policy (one
plan per model); `make_weight` applies it to a weight. On CUDA every weight is plain, except
GGUF blocks (packed, Triton kernels) and --quantization fp8's (ops/fp8.py).

Layers call `matmul(x, bias)`; the fused small-step op asks `streamed()` for the weight the
kernel reads (None: prepacked only); embeddings call `rows(ids)` (a tied LM head and its
embedding share one object). GGUF block-quantized tensors stay packed (`keep_packed`, the
policy's branch for them; `make_packed_weight`): the other weights of the model follow the plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.ops.linear import (TILE_ROWS, is_tiled, linear, onednn_above_rows, pack_weight,
                                packed_linear, small_batch_max_rows, tile_weight)

PLAIN, PREPACKED, PREPACKED_WITH_COPY, WIDENED = "plain", "prepacked", "prepacked+copy", "widened"
VARIANTS = (PLAIN, PREPACKED, PREPACKED_WITH_COPY, WIDENED)
QUANTIZED = "quantized"
# --quantization values: "gguf" (vLLM's; implied by a .gguf file) keeps the file's quantized
# tensors packed on CPU; "gguf-dequantized" (kvserve's) dequantizes them at load (float path).
GGUF, GGUF_DEQUANTIZED = "gguf", "gguf-dequantized"

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


def keep_packed(quantization: Optional[str], *, device: str, quant_kernel: bool,
                moe: bool = False) -> bool:
    """Whether a GGUF file's block-quantized tensors (ops.quant.PACKED_TYPES) stay packed: on
    CPU with the int8 kernel built (a decode step then streams 0.56-1.06 bytes a weight instead
    of float32's 4; benchmarks/quant_kernels.py), unless --quantization gguf-dequantized. The
    kernel-less fallback dequantizes per call, slower than dequantizing once at load. On CUDA
    the Triton kernels (ops/triton/quant.py) take the same packed blocks, for dense models
    (`moe`: a MoE model's packed experts have no CUDA path yet; its file is dequantized)."""
    return quantization == GGUF and ((device == "cpu" and quant_kernel)
                                     or (device == "cuda" and not moe))


class CpuLinearWeight:
    """The base of the variants, and "plain" itself. `weight` is the layer's Parameter (read
    through it: huge pages move its data after loading)."""
    variant = PLAIN
    # A prepacked copy takes over from the kernel above onednn_above_rows (float32 from 7 rows
    # on AVX-512), not only above small_batch_max_rows. Not for widened weights: their kernel
    # streams half the bytes of the float32 copy, a trade not measured there.
    early_onednn = True

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype,
                 packed: Optional[torch.Tensor] = None) -> None:
        self.weight = weight
        self.act_dtype = act_dtype
        self.packed = packed       # oneDNN's prepacked weight in act_dtype, if one is kept

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., K] @ weight.T (+ bias) in x's dtype: the kernel up to
        onednn_above_rows rows (8, float32 16; float32 6 on AVX-512), then the prepacked copy
        where there is one, else F.linear / widened_linear (ops.linear)."""
        if self.packed is not None and x.numel() > self._kernel_rows(x.dtype) * x.shape[-1]:
            return packed_linear(x, self.packed, bias)
        return linear(x, self.weight, bias)

    def _kernel_rows(self, x_dtype: torch.dtype) -> int:
        return onednn_above_rows(x_dtype) if self.early_onednn else small_batch_max_rows(x_dtype)

    def small_step_packed(self) -> Optional[torch.Tensor]:
        """The prepacked copy the fused small-step op runs above onednn_above_rows rows (as
        matmul does), or None: the kernel on streamed() for every row count it takes."""
        return self.packed if self.early_onednn else None

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
    variant = PREPACKED_WITH_COPY      # the plain (tiled) copy up to 8 / 16 rows, oneDNN above


class WidenedWeight(CpuLinearWeight):
    variant = WIDENED                  # 16-bit, float32 x; `packed`: a float32 copy or None
    early_onednn = False


class PackedWeight(CpuLinearWeight):
    """GGUF blocks kept packed: `parts`, stacked along the output rows, each a
    PackedQuantWeight (one GGUF type) or a float [rows, K] tensor (fused projections whose
    checkpoint tensors differ in type, e.g. Q4_K_M's Q6_K attn_v beside Q4_K q, k). The
    Parameter is emptied. `streamed()` is None: the fused small-step op takes the parts
    themselves (model/layers/fused_decode.py) and runs this matmul's arithmetic in C++."""
    variant = QUANTIZED

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype, parts: list) -> None:
        super().__init__(weight, act_dtype)
        self.parts = parts
        # The LM head's (set by the loader): logits from ~15-bit activations (a residual int8
        # row, PackedQuantWeight.matmul(precise=True)), so near-ties fall where float32's do.
        self.precise = False

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if len(self.parts) == 1:
            return self._part_matmul(self.parts[0], x, bias)
        y = torch.cat([self._part_matmul(p, x) for p in self.parts], dim=-1)
        return y if bias is None else y + bias

    def _part_matmul(self, part, x: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if isinstance(part, torch.Tensor):
            return F.linear(x, part.to(x.dtype), bias)
        return part.matmul(x, bias, precise=self.precise)

    def streamed(self) -> Optional[torch.Tensor]:
        return None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Only the gathered rows are dequantized (an embedding is one part)."""
        (part,) = self.parts
        if isinstance(part, torch.Tensor):
            return F.embedding(ids, part)
        return part.dequantize_rows(ids).reshape(*ids.shape, -1).to(self.act_dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def make_packed_weight(weight: torch.nn.Parameter, act_dtype: torch.dtype) -> PackedWeight:
    """The packed object of a Parameter whose weight loader kept GGUF blocks in
    `weight.quant_parts` ({first row: ops.quant.QuantizedRows}); rows no part covers were
    loaded as floats into the Parameter. Runs of one type become one PackedQuantWeight."""
    from kvserve.ops.quant.weight import QuantizedRows

    quant = sorted(weight.quant_parts.items())
    del weight.quant_parts
    n, pieces, row, run = weight.shape[0], [], 0, []

    def flush() -> None:
        if run:
            pieces.append(QuantizedRows.pack(run).to(weight.device))   # packed on the CPU
            run.clear()

    for start, part in quant:
        if start > row:
            flush()
            pieces.append(weight.data[row:start].to(act_dtype).clone())
        if run and run[0].qtype != part.qtype:
            flush()
        run.append(part)
        row = start + part.shape[0]
    flush()
    if row < n:
        pieces.append(weight.data[row:n].to(act_dtype).clone())
    weight.data = torch.empty(0, dtype=weight.dtype)    # never read again
    return PackedWeight(weight, act_dtype, pieces)


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

