"""The compiled packed-weight kernels (csrc/quant_linear.cpp), built like every CPU kernel.

`ops()` gives the ops (or None: no compiler, not x86-64, KVSERVE_DISABLE_CPU_KERNELS=1, a
failed build), looked up once per process:

    linear(x [M, K] f32, packed, qtype, n) -> [M, N] f32          int8 dot products (tier's path;
                                                                  gemm_min_rows()+: gemm where built)
    linear_generic(...)                                           the portable path, any build
    quantize_x(x, qtype) -> (q int8 [M, K], d f32, sums int32, sd f32)   llama.cpp's Q8_0/1/K blocks
    dequantize(packed, qtype, n, row0, row1) -> f32 [rows, K]     gguf-exact float32 rows
    dequantize_generic(...)                                       the same, the portable path
    dequantize_ids(packed, qtype, n, ids [R] int64) -> f32 [R, K]   rows `ids` (embeddings)
    gemm(x [M, K] bf16/f32, packed, qtype, n) -> [M, N] x's dtype  int8 GEMM (avx2 tier and up)
    gemm_supports(qtype) -> bool                                  whether this build has gemm for it
    gemm_min_rows() -> int                                        linear's rows for gemm (0: none)
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Optional

import torch

from kvserve.ops.build import CpuKernel

_KERNEL = CpuKernel("quant_linear.cpp", op="quant_linear", isa_op="quant_linear_isa",
                    what="packed GGUF linear", fallback="dequantized weights + F.linear")


def _load() -> Optional[SimpleNamespace]:
    if _KERNEL.get() is None:
        return None
    k = torch.ops.kvserve
    return SimpleNamespace(linear=k.quant_linear, linear_generic=k.quant_linear_generic,
                           quantize_x=k.quant_quantize_x, dequantize=k.quant_dequantize,
                           dequantize_generic=k.quant_dequantize_generic,
                           dequantize_ids=k.quant_dequantize_ids, gemm=k.quant_gemm,
                           gemm_supports=k.quant_gemm_supports,
                           gemm_min_rows=k.quant_gemm_min_rows)


@functools.lru_cache(maxsize=1)
def ops() -> Optional[SimpleNamespace]:
    """The compiled ops, or None (then PackedQuantWeight dequantizes with torch)."""
    return _load()


def isa() -> Optional[str]:
    """The built kernel's vector path ("avx2 ...", "generic"), or None without a kernel."""
    return _KERNEL.isa()
