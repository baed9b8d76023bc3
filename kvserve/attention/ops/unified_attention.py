"""Unified paged attention over a step's flattened tokens (Triton): prefill chunks with cached
context and decode rows in one launch.

    q                [T, H, D]       the step's queries, request by request
    kv_cache         [2, NB, BS, Hkv, D]   every query's own K/V already written
    query_start_loc  [R + 1] int32   request r's queries are rows [qsl[r], qsl[r + 1])
    seq_lens         [R] int32       tokens of request r after this step (context + queries)
    block_table      [R, MB] int32   padded; row r's first ceil(seq_lens[r] / BS) ids are read
    -> out           [T, H, D]

Query i of request r sits at position ctx + i (ctx = seq_len - q_len) and attends to keys
0 .. ctx + i. Query head h reads kv head h // G (G = H / Hkv).

A program owns BLOCK_Q consecutive queries of one request and one kv head: its BLOCK_M =
BLOCK_Q * G rows (query, head-in-group) share each K/V tile of TILE_N keys (several cache
blocks: each key's block id is read from the table), loaded once and multiplied with tl.dot;
the softmax is online (running max and sum per row). BLOCK_M is 64 rows and TILE_N 64 keys
whatever the step holds (a prefill's tiles on the tensor cores: a 4,096-token prompt's
attention took 1.6 ms a layer on an H100 with 16-row programs over 16-key blocks), so a row's
arithmetic never depends on the batch around it. Programs
are numbered so that request r's query blocks start at qsl[r] // BLOCK_Q + r (a bound that
grows with r whatever the query lengths), and each program finds its request by binary
search; programs past a request's last query block exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.ops.common import check_kv_cache, dot_in_fp32, next_pow2


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_keys(q, m_i, l_i, acc, cache_ptr, kv_off, k_pos, k_ok, q_pos, d, scale, stride_c_kv,
                 HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr):
    """The keys at k_pos (cache offsets kv_off [N, DIM_P]; k_ok: < seq_len) into the running
    softmax of the rows at positions q_pos [BLOCK_M] (causal: key pos <= query pos)."""
    # Slots past seq_len may hold anything (NaN too): never loaded, so 0 * NaN never happens.
    mask = k_ok[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(cache_ptr + kv_off, mask=mask, other=0.0)
    v = tl.load(cache_ptr + stride_c_kv + kv_off, mask=mask, other=0.0)
    s = _dot(q, tl.trans(k), DOT_F32).to(tl.float32) * scale            # [M, N]
    visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows that see nothing yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_F32).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def attend_block(q, m_i, l_i, acc, cache_ptr, blk, kvh, q_pos, seq_len, first_pos, scale,
                 stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
                 HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """One KV block (keys first_pos .. first_pos + BS) into the running softmax of the rows
    whose positions are q_pos [BLOCK_M] (causal: key pos <= query pos, and < seq_len)."""
    offs = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, DIM_P)
    k_pos = first_pos + offs
    kv_off = (blk.to(tl.int64) * stride_c_blk + offs[:, None] * stride_c_tok
              + kvh * stride_c_head + d[None, :])
    return _attend_keys(q, m_i, l_i, acc, cache_ptr, kv_off, k_pos, k_pos < seq_len, q_pos, d,
                        scale, stride_c_kv, HEAD_DIM, DOT_F32)


@triton.jit
def attend_tile(q, m_i, l_i, acc, cache_ptr, table_row_ptr, kvh, q_pos, seq_len, first_pos,
                scale, stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
                HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                TILE_N: tl.constexpr, DOT_F32: tl.constexpr):
    """Keys first_pos .. first_pos + TILE_N (spanning TILE_N / BLOCK_SIZE cache blocks, each
    key's block id read from the request's table row) into the running softmax of the rows
    at positions q_pos [BLOCK_M] (causal: key pos <= query pos, and < seq_len)."""
    k_pos = first_pos + tl.arange(0, TILE_N)
    d = tl.arange(0, DIM_P)
    k_ok = k_pos < seq_len
    # Table entries past the request's blocks are never read (they may be padding).
    blk = tl.load(table_row_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
    kv_off = (blk.to(tl.int64)[:, None] * stride_c_blk
              + (k_pos % BLOCK_SIZE)[:, None] * stride_c_tok + kvh * stride_c_head + d[None, :])
    return _attend_keys(q, m_i, l_i, acc, cache_ptr, kv_off, k_pos, k_ok, q_pos, d, scale,
                        stride_c_kv, HEAD_DIM, DOT_F32)


@triton.jit
def _find_request(query_start_ptr, num_reqs, pid, BLOCK_Q: tl.constexpr):
    """The last request r with qsl[r] // BLOCK_Q + r <= pid."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        go_right = first <= pid
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def _unified_attention_kernel(
        out_ptr, q_ptr, cache_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr,
        scale, num_reqs,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
        GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        TILE_N: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    r = _find_request(query_start_ptr, num_reqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_ptr + r)
    q_len = tl.load(query_start_ptr + r + 1) - q_start
    qb = pid - (q_start // BLOCK_Q + r)
    if qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    ctx_len = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_P)
    q_idx = qb * BLOCK_Q + m // GROUPS
    head = kvh * GROUPS + m % GROUPS
    row_ok = (m < BLOCK_Q * GROUPS) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    io_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    q_pos = ctx_len + q_idx

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P], tl.float32)
    # Keys this query block can see: up to its last query's position.
    last = tl.minimum(ctx_len + (qb + 1) * BLOCK_Q, seq_len)
    table_row = block_table_ptr + r.to(tl.int64) * stride_bt
    for j in range(0, tl.cdiv(last, TILE_N)):
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, cache_ptr, table_row, kvh, q_pos,
                                    seq_len, j * TILE_N, scale, stride_c_kv, stride_c_blk,
                                    stride_c_tok, stride_c_head, HEAD_DIM, DIM_P, BLOCK_SIZE,
                                    TILE_N, DOT_F32)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def block_m_for(groups: int) -> int:
    """Rows per program: at least 16 (tl.dot's minimum), a power of two, >= the group size."""
    return max(16, next_pow2(groups))


# The unified kernel's tiles: 64 query rows (queries x heads of a group) by 64 keys.
UNIFIED_BLOCK_M, UNIFIED_TILE_N = 64, 64


def unified_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every query row (see the module docstring for shapes)."""
    T, H, D = q.shape
    hkv = kv_cache.shape[3]
    check_kv_cache(kv_cache, hkv, D, "unified_attention")
    if H % hkv:
        raise ValueError(f"unified_attention: {H} query heads for {hkv} kv heads")
    R = seq_lens.shape[0]
    if query_start_loc.shape != (R + 1,) or block_table.dim() != 2 or block_table.shape[0] != R:
        raise ValueError("unified_attention: query_start_loc [R + 1], seq_lens [R] and "
                         f"block_table [R, MB] disagree: {tuple(query_start_loc.shape)}, "
                         f"{tuple(seq_lens.shape)}, {tuple(block_table.shape)}")
    if q.stride(2) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if T == 0 or R == 0:
        return out
    groups = H // hkv
    block_m = max(UNIFIED_BLOCK_M, block_m_for(groups))
    block_q = block_m // groups
    bs = kv_cache.shape[2]
    grid = (T // block_q + R, hkv)
    _unified_attention_kernel[grid](
        out, q, kv_cache, block_table, query_start_loc, seq_lens, float(scale), R,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        GROUPS=groups, HEAD_DIM=D, DIM_P=max(16, next_pow2(D)), BLOCK_SIZE=bs,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=max(UNIFIED_TILE_N, bs),
        DOT_F32=dot_in_fp32(kv_cache.dtype))
    return out
