"""KV-cache write: this step's K/V rows into their slots of the paged cache (Triton).

    key, value    [T, Hkv, D]
    kv_cache      [2, NB, BS, Hkv, D]
    slot_mapping  [T] int32/int64   slot s = block s // BS, offset s % BS; s < 0 = skip the row
                                    (the padding rows of a CUDA-graph batch)

One program per token writes all its heads (a [Hkv, D] tile) for K and V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.ops.common import check_kv_cache, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
        key_ptr, value_ptr, cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEADS_P: tl.constexpr, DIM_P: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, DIM_P)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + blk * stride_c_blk + off * stride_c_tok + h * stride_c_head + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] at slot_mapping [T] of kv_cache (in place)."""
    T, hkv, d = key.shape
    check_kv_cache(kv_cache, hkv, d, "reshape_and_cache")
    if value.shape != key.shape or slot_mapping.shape != (T,):
        raise ValueError(f"reshape_and_cache: key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"disagree")
    if key.stride(2) != 1 or value.stride(2) != 1:
        key, value = key.contiguous(), value.contiguous()
    if T == 0:
        return
    _reshape_and_cache_kernel[(T,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_SIZE=kv_cache.shape[2],
        HEADS_P=next_pow2(hkv), DIM_P=next_pow2(d))
