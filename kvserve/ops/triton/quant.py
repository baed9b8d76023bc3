"""GGUF block-quantized linear kernels of the CUDA path (Triton): the weight stays packed.

    quant_matmul(x [M, K], packed, fmt, n, bias, out)  -> y [M, N] in x's dtype
        M <= GEMV_MAX_ROWS: the GEMV kernel (decode, speculative verification); up to
        DOT_MAX_ROWS the tiled tl.dot kernel (decode batches, short prefills); else the weight
        dequantized to x's dtype in one pass, then cuBLAS (prefill), as vLLM's GGUF path does
        for large batches. The tl.dot kernel dequantizes each weight tile once per BM rows of
        x, so its time grows with M; the dequantizing pass costs the same at any M. On an
        H100 (benchmarks/quant_gpu.py, bf16 x, [16384, 2048] weight): tl.dot 43-66 / 176-179 /
        1348-1467 us at M = 16 / 64 / 512, dequantize + cuBLAS 324-344 us at each.
    dequantize_rows(packed, fmt, n, ids [R], dtype)    -> the rows `ids` as [R, K] (embeddings)

Layout: the CPU path's 8-row interleaved one (formats.py, packing.pack_blocks), unchanged, so a
PackedQuantWeight moves to the GPU with `.to("cuda")` and its other methods (dequantize, shard,
raw_rows) keep working. It also suits a GPU: a program takes whole 8-row groups, and one group's
blocks are one contiguous run of bytes, so a warp's loads are contiguous where GGUF's row layout
gives 8 separate streams; every quant field is in 4-byte units [unit][row][4], so the kernels
load int32 words (8 nibbles or 4 int8 each) and take the weights out with shifts; the group-block
sizes are multiples of 16 bytes, so the float16 scales and the words are aligned loads.

A step of either kernel dequantizes a tile of 256 weights per row in registers (8 blocks of a
32-weight type or one K-quant super-block) as float32, in the order the words give them, with
`kk` the column of each (x is loaded at the same columns, so the order never matters): w = d *
q (- m) as gguf.quants computes it, d and m float16 -> float32. The GEMV multiplies it with up
to GEMV_MAX_ROWS rows of x (x in its dtype, widened) accumulating in float32; the GEMM casts the
tile to x's dtype (float32 x: IEEE float32 dots, no TF32) for tl.dot with a [BM, 256] x tile
(bf16 under the interpreter: both widened, see the _gemm_kernel launch).

CUDA-graph safe: grids and workspaces depend only on shapes; nothing reads device data on the
host. On CPU the kernels run under Triton's interpreter (tests); the model uses them on CUDA.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from kvserve.ops.quant.formats import ROW_GROUP, BlockFormat
from kvserve.ops.triton import interpreting
from kvserve.ops.triton.counters import arrival_counters

__all__ = ["GEMV_MAX_ROWS", "DOT_MAX_ROWS", "quant_matmul", "dequantize_rows"]

# Rows of x up to which the GEMV kernel runs (it dequantizes each weight tile once for all rows).
GEMV_MAX_ROWS = 8
# Rows of x up to which the tl.dot kernel runs; past it the whole weight is dequantized once and
# cuBLAS multiplies (the crossover measured on an H100: see the module docstring).
DOT_MAX_ROWS = 128
TILE = 256      # weights per row per step (one super-block; 8 blocks of the 32-weight types)


@triton.jit
def _iq4_nl_value(q):
    """IQ4_NL's value of nibbles q (int32, 0..15), as int32: formats.IQ4_NL_VALUES as 4
    little-endian int32 words, value j byte j % 4 of word j // 4 (a lookup in registers)."""
    word = tl.where(q < 8, tl.where(q < 4, -1079142271, -152379953),
                    tl.where(q < 12, 639175937, 1901675829))
    return ((word >> (8 * (q & 3))) << 24) >> 24


@triton.jit
def _f16(p, blk, GBB: tl.constexpr, POS: tl.constexpr, idx, mask):
    """The float16 at byte POS + 2 idx of group-blocks `blk`, as float32 (0 where masked).
    Addressed in 2-byte units from a float16 base, so that the 8 rows' scales of a group are
    consecutive elements to Triton's pointer analysis (coalesced, vectorizable loads)."""
    ph = p.to(tl.pointer_type(tl.float16))
    return tl.load(ph + blk * (GBB // 2) + POS // 2 + idx, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u32(p, blk, GBB: tl.constexpr, POS: tl.constexpr, idx, mask):
    """The little-endian 32-bit word `idx` from byte POS (a multiple of 4) of group-blocks
    `blk` (0 where masked); in 4-byte units, as _f16."""
    pw = p.to(tl.pointer_type(tl.int32))
    return tl.load(pw + blk * (GBB // 4) + POS // 4 + idx, mask=mask, other=0)


@triton.jit
def _u8(p, blk, GBB: tl.constexpr, POS: tl.constexpr, idx, mask):
    return tl.load(p + blk * GBB + POS + idx, mask=mask, other=0)


@triton.jit
def _two_bit(p, blk, GBB: tl.constexpr, POS: tl.constexpr, hf, v, i, t, r, rmask):
    """A 2-bit field in Q6_K's qh layout at byte POS (Q6_K's qh, Q2_K's / Q3_K's qs): weight
    128 hf + 32 t + 4 (v % 8) + i at bits 2t of byte 32 hf + 4 (v % 8) + i."""
    return (_u32(p, blk, GBB, POS, 8 * (8 * hf + v % 8) + r, rmask) >> (8 * i + 2 * t)) & 3


@triton.jit
def _q4_family(p, gblk, r, rmask, blk0, nb, QT: tl.constexpr, GBB: tl.constexpr):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL (Q4_0's layout): 8 blocks [BN, 8 blocks, 4 words,
    8 nibbles]. Word u of a block holds bytes 4u..4u+3; nibble slot (i, h): byte i, low (h = 0:
    weight 4u + i) or high (h = 1: weight 4u + i + 16). Q5's high bits (packing's reordered
    u32): weight j = 4c + i at bit 8i + c, i.e. slot (i, h) of word u at bit 8i + 4h + u. Field
    byte offsets (formats.py): d 0; Q4_1 / Q5_1's m 16; qh 16 (Q5_0) / 32 (Q5_1); quants 16 /
    32 / 48 / 64 (IQ4_NL 16)."""
    b = blk0 + tl.arange(0, 8)[None, :, None, None]
    u = tl.arange(0, 4)[None, None, :, None]
    slot = tl.arange(0, 8)[None, None, None, :]
    shift = 8 * (slot % 4) + 4 * (slot // 4)
    kk = 32 * (b - blk0) + 4 * u + slot % 4 + 16 * (slot // 4)
    mask = rmask & (b < nb)
    blk = gblk + b
    d = _f16(p, blk, GBB, 0, r, mask)
    if QT == 2:
        q = (_u32(p, blk, GBB, 16, 8 * u + r, mask) >> shift) & 15
        w = d * (q - 8).to(tl.float32)
    elif QT == 20:
        q = (_u32(p, blk, GBB, 16, 8 * u + r, mask) >> shift) & 15
        w = d * _iq4_nl_value(q).to(tl.float32)
    elif QT == 3:
        q = (_u32(p, blk, GBB, 32, 8 * u + r, mask) >> shift) & 15
        w = d * q.to(tl.float32) + _f16(p, blk, GBB, 16, r, mask)
    elif QT == 6:
        q = (_u32(p, blk, GBB, 48, 8 * u + r, mask) >> shift) & 15
        q = q | (((_u32(p, blk, GBB, 16, r, mask) >> (shift + u)) & 1) << 4)
        w = d * (q - 16).to(tl.float32)
    else:
        q = (_u32(p, blk, GBB, 64, 8 * u + r, mask) >> shift) & 15
        q = q | (((_u32(p, blk, GBB, 32, r, mask) >> (shift + u)) & 1) << 4)
        w = d * q.to(tl.float32) + _f16(p, blk, GBB, 16, r, mask)
    return w, kk


@triton.jit
def _q8_0(p, gblk, r, rmask, blk0, nb):
    """Q8_0: 8 blocks [BN, 8 blocks, 8 words, 4 int8]: word u byte i is weight 4u + i."""
    b = blk0 + tl.arange(0, 8)[None, :, None, None]
    u = tl.arange(0, 8)[None, None, :, None]
    i = tl.arange(0, 4)[None, None, None, :]
    mask = rmask & (b < nb)
    blk = gblk + b
    d = _f16(p, blk, 272, 0, r, mask)
    q = (_u32(p, blk, 272, 16, 8 * u + r, mask) << (24 - 8 * i)) >> 24   # sign-extended
    return d * q.to(tl.float32), 32 * (b - blk0) + 4 * u + i


@triton.jit
def _k_quant(p, gblk, r, rmask, blk0, QT: tl.constexpr, GBB: tl.constexpr):
    """Q4_K / Q5_K: one super-block [BN, 4 (c), 8 (v), 8 nibble slots]: quant word u = 8c + v,
    slot (i, h) is weight 64c + 4v + i + 32h of sub-block 2c + h (llama.cpp's 32-byte runs,
    low nibbles then high). The scales are stored decoded (formats.py): scale s of row r at
    byte 32 + 8s + r, min s at 96 + 16(s // 2) + 2r + s % 2. Q5_K's high bit of weight j is bit
    j // 32 of qh byte j % 32 (qh at byte 160): word v, bit 8i + 2c + h. Quants at 160 / 416."""
    c = tl.arange(0, 4)[None, :, None, None]
    v = tl.arange(0, 8)[None, None, :, None]
    slot = tl.arange(0, 8)[None, None, None, :]
    i = slot % 4
    h = slot // 4
    blk = gblk + blk0
    if QT == 12:
        q = (_u32(p, blk, GBB, 160, 8 * (8 * c + v) + r, rmask) >> (8 * i + 4 * h)) & 15
    else:
        q = (_u32(p, blk, GBB, 416, 8 * (8 * c + v) + r, rmask) >> (8 * i + 4 * h)) & 15
        qh = _u32(p, blk, GBB, 160, 8 * v + r, rmask)
        q = q | (((qh >> (8 * i + 2 * c + h)) & 1) << 4)
    sc = _u8(p, blk, GBB, 32, 8 * (2 * c + h) + r, rmask).to(tl.float32)
    mn = _u8(p, blk, GBB, 96, 16 * c + 2 * r + h, rmask).to(tl.float32)
    d = _f16(p, blk, GBB, 0, r, rmask)
    dmin = _f16(p, blk, GBB, 16, r, rmask)
    return (d * sc) * q.to(tl.float32) - dmin * mn, 64 * c + 4 * v + i + 32 * h


@triton.jit
def _q6_k(p, gblk, r, rmask, blk0, QT: tl.constexpr, GBB: tl.constexpr):
    """Q6_K: one super-block [BN, 2 halves, 16 (v), 8 slots]: ql word u = 16 * half + v, slot
    (i, nib) is weight 128 half + 64 nib + 4v + i; its 2 high bits are in qh byte 32 half + 4 (v
    % 8) + i at bit 2 (2 nib + v // 8); its int8 scale is group (weight // 16), stored
    [group // 2][row][group % 2] at byte 16. d at 0, ql at 144, qh at 1168. Q2_K: q is Q6_K's
    2 high bits (qs at byte 160), the scale byte (at 32) holds sc (low nibble) and m (high),
    dmin at 16: w = d sc q - dmin m. Q3_K: Q6_K's scales; q's 2 low bits as Q2_K's (qs at 144),
    its third bit 4 half + t (t = 2 nib + v // 8) of hmask byte 4 (v % 8) + i (at 656), q - 4."""
    hf = tl.arange(0, 2)[None, :, None, None]
    v = tl.arange(0, 16)[None, None, :, None]
    slot = tl.arange(0, 8)[None, None, None, :]
    i = slot % 4
    nib = slot // 4
    blk = gblk + blk0
    kk = 128 * hf + 64 * nib + 4 * v + i
    g = kk // 16
    t = 2 * nib + v // 8                        # the weight's 32-block in its half
    d = _f16(p, blk, GBB, 0, r, rmask)
    if QT == 10:
        q2 = _two_bit(p, blk, GBB, 160, hf, v, i, t, r, rmask)
        sm = _u8(p, blk, GBB, 32, 16 * (g // 2) + 2 * r + g % 2, rmask).to(tl.int32)
        dmin = _f16(p, blk, GBB, 16, r, rmask)
        w = (d * (sm & 15).to(tl.float32)) * q2.to(tl.float32) - dmin * (sm >> 4).to(tl.float32)
    else:
        if QT == 14:
            ql = (_u32(p, blk, GBB, 144, 8 * (16 * hf + v) + r, rmask) >> (8 * i + 4 * nib)) & 15
            q = (ql | (_two_bit(p, blk, GBB, 1168, hf, v, i, t, r, rmask) << 4)) - 32
        else:
            lo = _two_bit(p, blk, GBB, 144, hf, v, i, t, r, rmask)
            hm = (_u32(p, blk, GBB, 656, 8 * (v % 8) + r, rmask) >> (8 * i + 4 * hf + t)) & 1
            q = (lo | (hm << 2)) - 4
        sc = _u8(p, blk, GBB, 16, 16 * (g // 2) + 2 * r + g % 2, rmask)
        w = (d * sc.to(tl.int8, bitcast=True).to(tl.float32)) * q.to(tl.float32)
    return w, kk


@triton.jit
def _tile(p, n, N, nb, t, QT: tl.constexpr, GBB: tl.constexpr, BN: tl.constexpr,
          WHOLE_GROUPS: tl.constexpr):
    """Tile t (weights [256 t, 256 t + 256) of each row) of rows n [BN], dequantized: (w [BN,
    256] float32, kk [256]: the column within the tile of each). Rows >= N give 0, except
    with WHOLE_GROUPS (n: whole 8-row groups, as the matmuls take them): then the padding rows
    of the last group are read too (they are in memory; their outputs are never stored), so
    that the mask is constant over a group and the loads of its 8 rows vectorize."""
    n4 = n[:, None, None, None]
    r = n4 % 8
    gblk = (n4 // 8).to(tl.int64) * nb          # the row group's first group-block
    if WHOLE_GROUPS:
        rmask = (n4 // 8) < (N + 7) // 8
    else:
        rmask = n4 < N
    if QT == 8:
        w, kk = _q8_0(p, gblk, r, rmask, 8 * t, nb)
    elif QT == 12 or QT == 13:
        w, kk = _k_quant(p, gblk, r, rmask, t, QT, GBB)
    elif QT == 14 or QT == 11 or QT == 10:
        w, kk = _q6_k(p, gblk, r, rmask, t, QT, GBB)
    else:
        w, kk = _q4_family(p, gblk, r, rmask, 8 * t, nb, QT, GBB)
    return tl.reshape(w, (BN, 256)), tl.reshape(kk, (256,))


@triton.jit
def _gemv_kernel(x_ptr, p, bias_ptr, out_ptr, final_ptr, counter_ptr, N, K, nb, tiles,
                 tiles_per_split, stride_x, stride_o, stride_split, stride_f, M,
                 MP: tl.constexpr, QT: tl.constexpr, GBB: tl.constexpr, BN: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED_MERGE: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] for BN rows n and all M rows of x; with SPLIT > 1,
    program (n-block, s) covers tiles [s * tiles_per_split, ...) and writes float32 partials
    to out[s]; FUSED_MERGE: the n-block's last split to finish (an arrival counter) sums them
    in split order (+ bias) into final (x's dtype) and resets the counter (a decode step's
    split GEMVs had a sum and a cast kernel each: 97 of a Q8_0 step's 246 launches on an
    H100); else the caller sums them. One row (decode): products accumulate elementwise in a
    [BN, 256] tile, reduced across the threads once at the end; more rows: reduced per tile
    (M such tiles would not fit in registers). M is a runtime value and MP (M rounded up to a
    power of two) the compiled one: 4 variants, not 8, and each is compiled when the decode
    graphs of 1 / 2 / 4 / 8 rows are captured, not by the first prefill of 3 or 5 tokens (on an
    H100 that compile landed inside a timed 1-token request)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    rows = tl.arange(0, MP)
    t0 = pid_s * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tiles)
    if MP == 1:
        acc2 = tl.zeros((BN, 256), dtype=tl.float32)
        for t in range(t0, t1):
            w, kk = _tile(p, n, N, nb, t, QT, GBB, BN, True)
            k = t * 256 + kk
            x1 = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            acc2 += w * x1[None, :]
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        acc = tl.zeros((MP, BN), dtype=tl.float32)
        for t in range(t0, t1):
            w, kk = _tile(p, n, N, nb, t, QT, GBB, BN, True)
            k = t * 256 + kk
            kmask = k < K
            for m in tl.static_range(MP):      # rows past M reread row M - 1, stored nowhere
                xm = tl.load(x_ptr + tl.minimum(m, M - 1) * stride_x + k, mask=kmask,
                             other=0.0).to(tl.float32)
                part = tl.sum(w * xm[None, :], axis=1)
                acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    if HAS_BIAS and SPLIT == 1:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (n[None, :] < N)
    out = out_ptr + pid_s.to(tl.int64) * stride_split + rows[:, None] * stride_o + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if FUSED_MERGE:
        # acq_rel: the other splits' partial stores are visible to the last one.
        if tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros((MP, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(out_ptr + s * stride_split + rows[:, None] * stride_o
                                 + n[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(final_ptr + rows[:, None] * stride_f + n[None, :],
                     total.to(final_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)      # ready for the next launch (graphs)


@triton.jit
def _gemm_kernel(x_ptr, p, bias_ptr, out_ptr, M, N, K, nb, tiles, stride_x, stride_o,
                 QT: tl.constexpr, GBB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr):
    """out[BM rows, BN cols] = x @ W^T: per tile, W's [BN, 256] dequantized and cast to x's
    dtype, then tl.dot with x's [BM, 256] at the same columns (float32 accumulation)."""
    pid = tl.program_id(0)
    m_blocks = tl.cdiv(M, BM)
    pid_m = pid % m_blocks          # consecutive programs share a weight tile (L2)
    pid_n = pid // m_blocks
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    mmask = m < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for t in range(0, tiles):
        w, kk = _tile(p, n, N, nb, t, QT, GBB, BN, True)
        k = t * 256 + kk
        xt = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :],
                     mask=mmask[:, None] & (k < K)[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(xt.to(tl.float32), tl.trans(w), acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc=acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + m[:, None].to(tl.int64) * stride_o + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & (n[None, :] < N))


@triton.jit
def _dequant_kernel(p, ids_ptr, out_ptr, R, N, K, nb, stride_o, QT: tl.constexpr,
                    GBB: tl.constexpr, BN: tl.constexpr):
    """out[j, :] = row ids[j] dequantized, for BN of the R ids and one tile (grid axis 1).
    Ids outside [0, N) give zero rows (no host check: this runs inside CUDA graphs)."""
    j = tl.program_id(0) * BN + tl.arange(0, BN)
    t = tl.program_id(1)
    n = tl.load(ids_ptr + j, mask=j < R, other=-1)
    n = tl.where(n < 0, N, n)          # out of range: a masked (zero) row
    w, kk = _tile(p, n.to(tl.int32), N, nb, t, QT, GBB, BN, False)
    k = t * 256 + kk
    tl.store(out_ptr + j[:, None].to(tl.int64) * stride_o + k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=(j < R)[:, None] & (k < K)[None, :])


# ------------------------------------------------------------------------------------------
# launchers

def _check(packed: torch.Tensor, fmt: BlockFormat, n: int, k: int) -> tuple[int, int]:
    """(blocks per row, tiles per row) after checking the packed shape."""
    fmt.check_k(k)
    nb = k // fmt.block_size
    want = (-(-n // ROW_GROUP), nb, fmt.group_block_bytes)
    if tuple(packed.shape) != want or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError(f"{fmt.name} [{n}, {k}]: packed blocks must be contiguous uint8 "
                         f"{list(want)}, got {list(packed.shape)} {packed.dtype}")
    return nb, -(-k // TILE)


# Programs the GEMV aims for: a decode step is bound by the bytes in flight, so every SM of a
# large GPU (H100: 132) should hold several programs. Not tuned on a GPU yet: benchmarks/
# quant_gpu.py --gemv-sweep times the alternatives.
GEMV_PROGRAMS = 1024


def _gemv_config(n: int, tiles: int) -> tuple[int, int]:
    """(rows per program, K splits): GEMV_PROGRAMS programs from the n / BN row blocks where
    there are that many, else K split (in halves, each part >= 2 tiles) until there are."""
    bn = 16 if n >= 16 * GEMV_PROGRAMS else 8
    programs = -(-n // bn)
    split = 1
    while programs * split < GEMV_PROGRAMS and tiles // (split * 2) >= 2:
        split *= 2
    return bn, split


def _gemm_config(m: int) -> tuple[int, int, int]:
    """(BM, BN, num_warps) of the tl.dot kernel."""
    return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 8


def quant_matmul(x: torch.Tensor, packed: torch.Tensor, fmt: BlockFormat, n: int,
                 bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 gemv_config: Optional[tuple[int, int]] = None,
                 path: Optional[str] = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T (+ bias) in x's dtype, W the [n, K] weight in `packed`
    (formats.py's layout). x needs a contiguous last dim (its rows may be strided: only the
    first K columns are read); `out` ([M, N] of x's dtype, last dim contiguous) is written
    instead of a new tensor. `gemv_config`: (rows per program, K splits) in place of
    _gemv_config's; `path` ("gemv" up to GEMV_MAX_ROWS rows, "dot", "dequant") in place of
    the default choice by M (benchmarks, tests)."""
    if x.dim() != 2:
        raise ValueError(f"quant_matmul: x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    nb, tiles = _check(packed, fmt, n, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"quant_matmul: out must be [{m}, {n}] {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"quant_matmul: bias must be [{n}], got {tuple(bias.shape)}")
    path = path or ("gemv" if m <= GEMV_MAX_ROWS else "dot" if m <= DOT_MAX_ROWS else "dequant")
    if path not in ("gemv", "dequant", "dot") or (path == "gemv" and m > GEMV_MAX_ROWS):
        raise ValueError(f"quant_matmul: path {path!r} for {m} rows; 'gemv' (up to "
                         f"{GEMV_MAX_ROWS} rows), 'dequant' or 'dot'")
    if path == "dequant" and m and n:
        w = _dequantize_all(packed, fmt, n, k, x.dtype)
        y = torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
        return out.copy_(y) if out is not None else y
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    qt, gbb = fmt.ggml_type, fmt.group_block_bytes
    b = bias if bias is not None else x
    if path == "gemv":
        bn, split = gemv_config or _gemv_config(n, tiles)
        warps = 4 if bn <= 16 else 8
        per = -(-tiles // split)
        mp = 1 << (m - 1).bit_length()
        if split == 1:
            _gemv_kernel[(triton.cdiv(n, bn), 1)](
                x, packed, b, out, out, packed, n, k, nb, tiles, per, x.stride(0),
                out.stride(0), 0, 0, M=m, MP=mp, QT=qt, GBB=gbb, BN=bn,
                HAS_BIAS=bias is not None, SPLIT=1, FUSED_MERGE=False, num_warps=warps)
            return out
        ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        counters = arrival_counters("packed_gemv", x.device, triton.cdiv(n, bn))
        _gemv_kernel[(triton.cdiv(n, bn), split)](
            x, packed, b, ws, out, ws if counters is None else counters, n, k, nb, tiles,
            per, x.stride(0), n, m * n, out.stride(0), M=m, MP=mp, QT=qt, GBB=gbb, BN=bn,
            HAS_BIAS=bias is not None, SPLIT=split, FUSED_MERGE=counters is not None,
            num_warps=warps)
        if counters is None:        # a capture that would need a larger counter buffer
            y = ws.sum(0)
            if bias is not None:
                y += bias.float()
            out.copy_(y)
        return out
    bm, bn, warps = _gemm_config(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](x, packed, b, out, m, n, k, nb, tiles, x.stride(0), out.stride(0),
                       QT=qt, GBB=gbb, BM=bm, BN=bn, HAS_BIAS=bias is not None,
                       # Triton's interpreter computes tl.dot on bfloat16 operands wrongly
                       # (attention/ops/common.py found it too): there the bf16 tile widens.
                       DOT_F32=x.dtype == torch.float32 or (x.dtype == torch.bfloat16
                                                            and interpreting()),
                       num_warps=warps)
    return out


def _dequantize_all(packed: torch.Tensor, fmt: BlockFormat, n: int, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The whole [n, k] weight in `dtype` (a transient copy for one product)."""
    return dequantize_rows(packed, fmt, n, k, torch.arange(n, device=packed.device), dtype)


def dequantize_rows(packed: torch.Tensor, fmt: BlockFormat, n: int, k: int, ids: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `ids` (any int tensor on packed's device) of the [n, k] weight as [len(ids), k]
    `dtype` (float32: gguf's values exactly). Ids outside [0, n) give zero rows."""
    nb, tiles = _check(packed, fmt, n, k)
    ids = ids.reshape(-1)
    r = ids.numel()
    out = torch.empty(r, k, dtype=dtype, device=packed.device)
    if r:
        bn = 16
        _dequant_kernel[(triton.cdiv(r, bn), tiles)](
            packed, ids, out, r, n, k, nb, out.stride(0), QT=fmt.ggml_type,
            GBB=fmt.group_block_bytes, BN=bn, num_warps=4)
    return out
