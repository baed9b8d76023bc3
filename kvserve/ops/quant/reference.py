"""References for the packed kernels (tests and benchmarks; nothing here is on a hot path).

- quantize_activations: the activations' int8 blocks exactly as the C++ kernel makes them
  (llama.cpp's Q8_0 / Q8_1, and those with a float32 scale for the K-quants; float32
  operations in the same order).
- dequantize_gguf: gguf.quants.dequantize, the ground truth for the weights.
- reference_matmul: y = W @ x^T in float64 from those two, i.e. what the integer kernel computes
  up to its float32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvserve.ops.quant.formats import BlockFormat


@dataclass
class QuantizedActivations:
    """x [M, K] as int8 blocks: q [M, K] int8, d [M, K / act_block] float32 (one scale per
    block), sums [M, K / act_sum_group] int32 (sums of q over each group), sd [M, K / 32]
    float32 (d * sum: Q8_1's fp16 of it for the _1 types' minimum, float32 for the K-quants'
    minimums; zeros otherwise)."""
    q: np.ndarray
    d: np.ndarray
    sums: np.ndarray
    sd: np.ndarray

    def dequantized(self, fmt: BlockFormat) -> np.ndarray:
        """q * d in float64: the activations the integer kernel multiplies."""
        m, k = self.q.shape
        q = self.q.astype(np.float64).reshape(m, k // fmt.act_block, fmt.act_block)
        return (q * self.d.astype(np.float64)[..., None]).reshape(m, k)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def quantize_activations(x: np.ndarray, fmt: BlockFormat) -> QuantizedActivations:
    """x [M, K] float32 -> the kernel's int8 blocks of 32 for fmt (csrc/quant_linear.cpp has
    the rules): llama.cpp's Q8_0 / Q8_1 (its x86 "vec_dot_type") for the 32-weight types; for
    the K-quants the same blocks with the float32 scale kept (not rounded to float16) and sd
    = d * sum q in float32 (formats.py: why not llama.cpp's Q8_K)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    blocks = x.reshape(m, k // fmt.act_block, fmt.act_block)
    f32 = np.float32
    with np.errstate(divide="ignore", invalid="ignore"):
        amax = np.abs(blocks).max(axis=-1)
        inv = np.where(amax != 0, f32(127) / amax, f32(0)).astype(f32)
        q = np.clip(np.rint(blocks * inv[..., None]), -127, 127)
        d_full = (amax / f32(127)).astype(f32)
    d = d_full if fmt.k_quant else _f16(d_full)
    q = q.astype(np.int8).reshape(m, k)
    sums = q.astype(np.int32).reshape(m, k // fmt.act_sum_group, fmt.act_sum_group).sum(-1)
    sums32 = q.astype(np.int32).reshape(m, k // 32, 32).sum(-1).astype(f32)
    sd = np.zeros_like(d)
    if fmt.name in Q8_1_TYPES:
        sd = _f16((d_full * sums32).astype(f32))
    elif fmt.k_quant:
        sd = (d_full * sums32).astype(f32)
    return QuantizedActivations(q, d.astype(f32), sums.astype(np.int32), sd)


# Weight types whose activations are Q8_1 blocks (the block sum's scaled term, for the minimum).
Q8_1_TYPES = ("Q4_1", "Q5_1")


def dequantize_gguf(raw: np.ndarray, fmt: BlockFormat, shape: tuple[int, int]) -> np.ndarray:
    """gguf's own dequantizer on raw blocks [N, row_bytes] -> float32 [N, K]."""
    from gguf import GGMLQuantizationType, quants

    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    return quants.dequantize(raw, GGMLQuantizationType[fmt.name]).reshape(shape)


def reference_matmul(x: np.ndarray, raw: np.ndarray, fmt: BlockFormat,
                     shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(y [M, N], bound [M, N]) in float64: y = x_q @ W^T with W dequantized by gguf and x
    quantized by quantize_activations (the _1 types' minimum times Q8_1's rounded block term,
    as llama.cpp's dot product has it); bound = |x_q| @ |W|^T, the scale that the kernel's
    float32 rounding error is relative to."""
    w = dequantize_gguf(raw, fmt, shape).astype(np.float64)
    xa = quantize_activations(x, fmt)
    xq = xa.dequantized(fmt)
    bound = np.abs(xq) @ np.abs(w).T
    if fmt.name not in Q8_1_TYPES:
        return xq @ w.T, bound
    n, k = shape
    nb = k // fmt.block_size
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, nb, fmt.type_size)
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)   # [N, nb]
    w_no_min = w - np.repeat(mins, fmt.block_size, axis=1)
    return xq @ w_no_min.T + xa.sd.astype(np.float64) @ mins.T, bound
