"""Split-KV (flash-decoding) paged attention for steps where every request decodes one token
(Triton): long contexts at small batch give too few (request, kv head) programs to fill a
GPU, so each sequence's blocks are split into `num_splits` ranges attended in parallel, and the
partial results are merged by their log-sum-exp: by the last split program of each (request,
kv head) to finish (an arrival counter), or with `fused_merge=False` by a second kernel.

    q            [R, H, D]        one query per request (row r = request r)
    kv_cache     [2, NB, BS, Hkv, D]
    seq_lens     [R] int32        keys 0 .. seq_len - 1 (the query's own K/V already written);
                                  0 = a padding row (CUDA graphs): its output is zero
    block_table  [R, MB] int32
    -> out       [R, H, D]

Everything a program reads is sized by its arguments' shapes and `num_splits`, never by a
value on the device: the launch is the same for every step of one batch size, as a captured
CUDA graph needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.ops.common import check_kv_cache, dot_in_fp32, next_pow2
from kvserve.attention.ops.unified_attention import attend_block, block_m_for
from kvserve.ops.triton.counters import arrival_counters


@triton.jit
def _split_kv_kernel(
        out_ptr, part_out_ptr, part_lse_ptr, q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,
        counter_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh,
        stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_P: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
        DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        DOT_F32: tl.constexpr, FUSED_MERGE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + r)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    b0 = split * per_split
    b1 = tl.minimum(b0 + per_split, num_blocks)

    g = tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_P)
    head = kvh * GROUPS + g
    row_ok = g < GROUPS
    q = tl.load(q_ptr + r * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    q_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P], tl.float32)
    for j in range(b0, b1):
        blk = tl.load(block_table_ptr + r * stride_bt + j)
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, cache_ptr, blk, kvh, q_pos, seq_len,
                                     j * BLOCK_SIZE, scale, stride_c_kv, stride_c_blk,
                                     stride_c_tok, stride_c_head, HEAD_DIM, DIM_P,
                                     BLOCK_SIZE, DOT_F32)
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:     # the final output: no merge kernel
        tl.store(out_ptr + r * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))
    else:   # this split's normalised output and its log-sum-exp (-inf if empty)
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (r * NUM_HEADS + head) * NUM_SPLITS + split                   # [BLOCK_M]
        tl.store(part_out_ptr + row[:, None] * DIM_P + d[None, :], out, mask=row_ok[:, None])
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
        if FUSED_MERGE:
            # The last split of this (request, kv head) to finish merges all of them: no
            # second kernel. acq_rel: the other splits' stores above are visible to it.
            slot = counter_ptr + r * NUM_KV_HEADS + kvh
            if tl.atomic_add(slot, 1, sem="acq_rel") == NUM_SPLITS - 1:
                _merge_rows(out_ptr, part_out_ptr, part_lse_ptr, r, head, row_ok, d,
                            stride_ot, stride_oh, NUM_HEADS, NUM_SPLITS, SPLITS_P, HEAD_DIM,
                            DIM_P)
                tl.atomic_xchg(slot, 0)         # ready for the next launch (graph replays)


@triton.jit
def _merge_rows(out_ptr, part_out_ptr, part_lse_ptr, r, head, row_ok, d, stride_ot, stride_oh,
                NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr):
    """_merge_splits_kernel's arithmetic for the heads `head` [BLOCK_M] of request r."""
    s = tl.arange(0, SPLITS_P)
    base = (r * NUM_HEADS + head) * NUM_SPLITS                              # [BLOCK_M]
    s_ok = row_ok[:, None] & (s[None, :] < NUM_SPLITS)
    lse = tl.load(part_lse_ptr + base[:, None] + s[None, :], mask=s_ok, other=float("-inf"),
                  cache_modifier=".cg")                                     # [BLOCK_M, S]
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m[:, None])                          # 0 for empty splits
    parts = tl.load(part_out_ptr + (base[:, None, None] + s[None, :, None]) * DIM_P
                    + d[None, None, :], mask=s_ok[:, :, None], other=0.0,
                    cache_modifier=".cg")                                   # [BLOCK_M, S, D]
    total = tl.sum(w, 1)
    out = tl.sum(parts * w[:, :, None], 1) / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + r * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit
def _merge_splits_kernel(out_ptr, part_out_ptr, part_lse_ptr, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, DIM_P)
    base = (r * NUM_HEADS + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)                                   # 0 for empty splits
    parts = tl.load(part_out_ptr + (base + s)[:, None] * DIM_P + d[None, :],
                    mask=(s < NUM_SPLITS)[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + r * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def choose_num_splits(num_reqs: int, num_kv_heads: int, target_programs: int = 256,
                      max_splits: int = 16) -> int:
    """Splits per sequence so that (requests x kv heads x splits) is about `target_programs`:
    a power of two in [1, max_splits], from shapes only (stable for a captured batch size)."""
    want = max(1, target_programs // max(1, num_reqs * num_kv_heads))
    return min(max_splits, 1 << (want.bit_length() - 1))


def _merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The fused merge's arrival counters, one per (request, kv head); None while a CUDA
    graph is captured and the buffer is too small (the launch then takes the merge kernel)."""
    return arrival_counters("split_kv_decode", device, n)


def split_kv_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, scale: float, num_splits: int,
                              out: torch.Tensor | None = None,
                              fused_merge: bool = True) -> torch.Tensor:
    """Decode attention, one query per request (see the module docstring)."""
    R, H, D = q.shape
    hkv = kv_cache.shape[3]
    check_kv_cache(kv_cache, hkv, D, "split_kv_decode_attention")
    if H % hkv or seq_lens.shape != (R,) or block_table.dim() != 2 or block_table.shape[0] != R:
        raise ValueError(f"split_kv_decode_attention: q {tuple(q.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)}, block_table {tuple(block_table.shape)} and "
                         f"{hkv} kv heads disagree")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if R == 0:
        return out
    dim_p = max(16, next_pow2(D))
    parts = max(1, R * H * num_splits) if num_splits > 1 else 1
    part_out = torch.empty(parts, dim_p, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(parts, dtype=torch.float32, device=q.device)
    groups = H // hkv
    counters = _merge_counters(q.device, R * hkv) if num_splits > 1 and fused_merge else None
    _split_kv_kernel[(R, hkv, num_splits)](
        out, part_out, part_lse, q, kv_cache, block_table, seq_lens,
        part_lse if counters is None else counters, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        NUM_HEADS=H, NUM_KV_HEADS=hkv, NUM_SPLITS=num_splits, SPLITS_P=next_pow2(num_splits),
        GROUPS=groups, HEAD_DIM=D, DIM_P=dim_p, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m_for(groups), DOT_F32=dot_in_fp32(kv_cache.dtype),
        FUSED_MERGE=counters is not None)
    if num_splits > 1 and counters is None:
        _merge_splits_kernel[(R, H)](
            out, part_out, part_lse, out.stride(0), out.stride(1),
            NUM_HEADS=H, NUM_SPLITS=num_splits, SPLITS_P=next_pow2(num_splits),
            HEAD_DIM=D, DIM_P=dim_p)
    return out
