"""References for the packed kernels (tests and benchmarks; nothing here is on a hot path).

- quantize_activations: the activations' int8 blocks exactly as the C++ kernel makes them
  (float32 operations in the same order: amax, d = amax / 127, id = 1 / d, q = rint(x * id)).
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
    block), sums [M, K / act_sum_group] int32 (sums of q over each group)."""
    q: np.ndarray
    d: np.ndarray
    sums: np.ndarray

    def dequantized(self, fmt: BlockFormat) -> np.ndarray:
        """q * d in float64: the activations the integer kernel multiplies."""
        m, k = self.q.shape
        q = self.q.astype(np.float64).reshape(m, k // fmt.act_block, fmt.act_block)
        return (q * self.d.astype(np.float64)[..., None]).reshape(m, k)


def quantize_activations(x: np.ndarray, fmt: BlockFormat) -> QuantizedActivations:
    """x [M, K] float32 -> int8 blocks of fmt.act_block values with a float32 scale each."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, k = x.shape
    blocks = x.reshape(m, k // fmt.act_block, fmt.act_block)
    amax = np.abs(blocks).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8).reshape(m, k)
    sums = q.astype(np.int32).reshape(m, k // fmt.act_sum_group, fmt.act_sum_group).sum(-1)
    return QuantizedActivations(q, d, sums.astype(np.int32))


def dequantize_gguf(raw: np.ndarray, fmt: BlockFormat, shape: tuple[int, int]) -> np.ndarray:
    """gguf's own dequantizer on raw blocks [N, row_bytes] -> float32 [N, K]."""
    from gguf import GGMLQuantizationType, quants

    out = quants.dequantize(np.ascontiguousarray(raw, dtype=np.uint8),
                            GGMLQuantizationType[fmt.name])
    return out.reshape(shape)


def reference_matmul(x: np.ndarray, raw: np.ndarray, fmt: BlockFormat,
                     shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(y [M, N], bound [M, N]) in float64: y = x_q @ W^T with W dequantized by gguf and x
    quantized by quantize_activations; bound = |x_q| @ |W|^T, the scale that the kernel's
    float32 rounding error is relative to."""
    w = dequantize_gguf(raw, fmt, shape).astype(np.float64)
    xq = quantize_activations(x, fmt).dequantized(fmt)
    return xq @ w.T, np.abs(xq) @ np.abs(w).T
