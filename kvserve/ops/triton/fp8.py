"""Per-token float8 (e4m3) quantization of activations in one Triton kernel (ops/fp8.py's CUDA
path: --quantization fp8 quantizes x before every _scaled_mm; as torch ops that is five
kernels a linear, which a batch-1 decode step would spend more time launching than reading
its weights).

    quantize_rows(x [M, K]) -> (x_q float8_e4m3fn [M, K], scale float32 [M, 1])

One program per row: scale = max(max|x| / 448, MIN_SCALE), x_q = x / scale rounded to e4m3,
the same values as ops.fp8.quantize_activations (torch's round-to-nearest-even cast) bit for
bit. The rounding is done in float32 (to the e4m3 grid: 3 mantissa bits, subnormals below
2^-6 in steps of 2^-9) before the cast, which then converts exact values only: Triton's CPU
interpreter mis-rounds inexact float -> fp8 casts (GPUs round in hardware, to the same grid).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)


@triton.jit
def _round_e4m3(v):
    """v (|v| <= 448, float32) rounded to the nearest e4m3 value, ties to even."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127        # floor(log2 a), normals
    e = tl.maximum(e, -6)                                          # subnormals: 2^-9 steps
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)   # 2^(e - 3), exact
    y = v / quantum
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))
    return r * quantum


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < K
    v = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(v), axis=0) / 448.0, 1.0 / (448.0 * 512.0))
    q = _round_e4m3(tl.minimum(tl.maximum(v / scale, -448.0), 448.0))
    tl.store(q_ptr + row * stride_q + c, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (x_q float8_e4m3fn [M, K], scale float32 [M, 1])."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [M, K], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block,
                                    num_warps=min(16, max(1, block // 512)))
    return q, s
