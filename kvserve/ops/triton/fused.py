"""Fused elementwise kernels of the CUDA path (Triton), one kernel where vLLM has one custom op.

    fused_add_rms_norm   x, residual [T, N]  ->  x = rms_norm(x + residual) * w, residual = x + r
    rms_norm             x [T, N]            ->  rms_norm(x) * w
    rotary_embedding     q [T, Hq*D], k [T, Hk*D] rotated in place at positions [T] (neox halves)
    rotary_embedding_and_cache   the same, and k (rotated) and v written at slot_mapping [T]
                                 into the paged cache [2, NB, BS, Hkv, D] (TRITON_ATTN's layout)
    silu_and_mul         x [T, 2I] = gate | up  ->  silu(gate) * up [T, I]
    silu_and_mul_linear  x [T, 2I], w [N, I]  ->  silu_and_mul(x) @ w.T [T, N] (a GEMV for a
                         few rows: the activation is made while the weight streams)

Arithmetic: float32 inside, rounded to the model dtype where Hugging Face's modules round
(the residual sum, the normalised value before the weight, the activation before the
multiply), so results match the torch ops to an ulp. Every kernel gives each token its own
program and reduces over a fixed width: a token's result never depends on the batch size.
On CPU the kernels run under Triton's interpreter (tests); the model uses them on CUDA only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl



def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int, what: str) -> None:
    """The paged layout of TRITON_ATTN (kvserve/attention/ops/common.py checks the same)."""
    if (kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3] != num_kv_heads
            or kv_cache.shape[4] != head_dim or kv_cache.stride(4) != 1):
        raise ValueError(f"{what}: kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, "
                         f"{head_dim}] with a contiguous last dim, got {tuple(kv_cache.shape)}")

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "rotary_embedding_and_cache",
           "silu_and_mul", "silu_and_mul_linear"]


# ------------------------------------------------------------------------------------------
# RMSNorm (+ residual add)

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)     # HF adds in the model dtype
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    normed = (h * tl.math.rsqrt(var + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, N] with a contiguous last dim (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_launch(x: torch.Tensor, residual: "torch.Tensor | None", weight: torch.Tensor,
                 out: torch.Tensor, eps: float) -> None:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {n}")
    if x.shape[0] == 0:
        return
    block = next_pow2(n)
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (a new tensor)."""
    x2 = _rows(x)
    out = torch.empty_like(x2)
    _norm_launch(x2, None, weight, out, eps)
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel: in place when x and residual are
    contiguous rows (x becomes the output, residual the sum), else on copies."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} differ")
    x2, r2 = _rows(x), _rows(residual)
    _norm_launch(x2, r2, weight, x2, eps)
    return x2.view(x.shape), r2.view(residual.shape)


# ------------------------------------------------------------------------------------------
# Rotary embedding (neox: rotate the two halves of each head), optionally + KV-cache write

@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, t, cos, sin, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    """Rotate the [NUM_HEADS, 2*HALF] heads of token t in place; returns both rotated halves
    (float32) for the cache write."""
    h = tl.arange(0, HEADS_P)[:, None]
    i = tl.arange(0, HALF_P)[None, :]
    mask = (h < NUM_HEADS) & (i < HALF)
    p1 = ptr + t * stride_t + h * stride_h + i
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    o1 = (a * cos - b * sin).to(dtype)
    o2 = (b * cos + a * sin).to(dtype)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_cos, stride_c_kv, stride_c_blk, stride_c_tok, stride_c_head,
                   NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   Q_HEADS_P: tl.constexpr, KV_HEADS_P: tl.constexpr, HALF_P: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, WRITE_CACHE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_P)[None, :]
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + i, mask=i < HALF, other=0.0)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, cos, sin, NUM_Q_HEADS, HALF, Q_HEADS_P, HALF_P)
    k1, k2 = _rotate_heads(k_ptr, stride_kt, stride_kh, t, cos, sin, NUM_KV_HEADS, HALF,
                           KV_HEADS_P, HALF_P)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:      # < 0: a padding row of a CUDA-graph batch
            h = tl.arange(0, KV_HEADS_P)[:, None]
            mask = (h < NUM_KV_HEADS) & (i < HALF)
            dst = (cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk
                   + (slot % BLOCK_SIZE) * stride_c_tok + h * stride_c_head + i)
            ety = cache_ptr.dtype.element_ty
            tl.store(dst, k1.to(ety), mask=mask)
            tl.store(dst + HALF, k2.to(ety), mask=mask)
            vp = v_ptr + t * stride_vt + h * stride_vh + i
            tl.store(dst + stride_c_kv, tl.load(vp, mask=mask).to(ety), mask=mask)
            tl.store(dst + stride_c_kv + HALF, tl.load(vp + HALF, mask=mask).to(ety), mask=mask)


def _head_strides(x: torch.Tensor, head_size: int, what: str) -> tuple[int, int, int]:
    """(token stride, head stride, number of heads) of x [T, H*D] or [T, H, D]."""
    if x.stride(-1) != 1:
        raise ValueError(f"rotary_embedding: {what}'s last dim must be contiguous")
    if x.dim() == 3:
        if x.shape[2] != head_size:
            raise ValueError(f"rotary_embedding: {what} head size {x.shape[2]} != {head_size}")
        return x.stride(0), x.stride(1), x.shape[1]
    if x.dim() != 2 or x.shape[1] % head_size:
        raise ValueError(f"rotary_embedding: {what} {tuple(x.shape)} is not [T, H*{head_size}]")
    return x.stride(0), head_size, x.shape[1] // head_size


def _rotary_launch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: "torch.Tensor | None", head_size: int, cos_cache: torch.Tensor,
                   sin_cache: torch.Tensor, kv_cache: "torch.Tensor | None",
                   slot_mapping: "torch.Tensor | None") -> None:
    T = q.shape[0]
    if head_size % 2 or cos_cache.shape != sin_cache.shape or cos_cache.shape[1] * 2 != head_size:
        raise ValueError(f"rotary_embedding: tables {tuple(cos_cache.shape)} do not fit head "
                         f"size {head_size}")
    if positions.shape != (T,) or k.shape[0] != T:
        raise ValueError("rotary_embedding: positions, q and k must have one row per token")
    sqt, sqh, hq = _head_strides(q, head_size, "q")
    skt, skh, hk = _head_strides(k, head_size, "k")
    write = kv_cache is not None
    if write:
        assert v is not None and slot_mapping is not None
        check_kv_cache(kv_cache, hk, head_size, "rotary_embedding_and_cache")
        svt, svh, hv = _head_strides(v, head_size, "v")
        if hv != hk or slot_mapping.shape != (T,):
            raise ValueError("rotary_embedding_and_cache: v or slot_mapping does not match k")
        cache, slots, bs = kv_cache, slot_mapping, kv_cache.shape[2]
        cstrides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    else:
        v, svt, svh, cache, slots, bs, cstrides = k, 0, 0, k, positions, 16, (0, 0, 0, 0)
    if T == 0:
        return
    half = head_size // 2
    _rotary_kernel[(T,)](
        positions, q, k, v, cos_cache, sin_cache, cache, slots,
        sqt, sqh, skt, skh, svt, svh, cos_cache.stride(0), *cstrides,
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hk, HALF=half, Q_HEADS_P=next_pow2(hq),
        KV_HEADS_P=next_pow2(hk), HALF_P=next_pow2(half), BLOCK_SIZE=bs, WRITE_CACHE=write)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (one kernel for both); returns them."""
    _rotary_launch(positions, q, k, None, head_size, cos_cache, sin_cache, None, None)
    return q, k


def rotary_embedding_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                               v: torch.Tensor, head_size: int, cos_cache: torch.Tensor,
                               sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place and write k (rotated) and v into the paged cache at
    slot_mapping (slots < 0 are skipped), in one kernel; returns q and k."""
    _rotary_launch(positions, q, k, v, head_size, cos_cache, sin_cache, kv_cache, slot_mapping)
    return q, k


# ------------------------------------------------------------------------------------------
# SiLU-and-mul

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
    dtype = g.dtype
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dtype)      # F.silu rounds to the dtype, then * up
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(dtype),
             mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = gate | up -> silu(gate) * up [..., I]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim {x.shape[-1]} is odd")
    x2 = _rows(x)
    inter = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, next_pow2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block)
    return out.view(*x.shape[:-1], inter)


# ------------------------------------------------------------------------------------------
# SiLU-and-mul + the down projection, for a few rows (batch-1 decode)
#
# cuBLAS runs a batch-1 down projection (K = intermediate, wide) as a split-K GEMM plus a
# reduce kernel, after the activation kernel: three launches per layer. This GEMV streams the
# weight once with the activation computed on the fly: one launch, no split (each program owns
# BLOCK_N outputs over the whole K, so a row's result does not depend on the batch size).
# Measured on an H100 (bf16, 2048 x 8192, one row): 25 us against 29 us for the three kernels.

@triton.jit
def _silu_and_mul_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, I, stride_x, stride_w, stride_o,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + offs_k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xo = offs_m[:, None] * stride_x + offs_k[None, :]
        xm = m_ok[:, None] & k_ok[None, :]
        g = tl.load(x_ptr + xo, mask=xm, other=0.0)
        u = tl.load(x_ptr + xo + I, mask=xm, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)     # silu_and_mul's rounding points
        a = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
        acc += tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


SILU_LINEAR_MAX_ROWS = 1     # measured: at 4 rows cuBLAS's GEMM is faster (33 vs 37 us)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = gate | up, weight [N, I] -> silu_and_mul(x) @ weight.T [T, N] (T small)."""
    x2 = _rows(x)
    n, inter = weight.shape
    if x2.shape[1] != 2 * inter or weight.stride(1) != 1:
        raise ValueError(f"silu_and_mul_linear: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} disagree (x must be [T, 2 * {inter}])")
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        # H100 sweep (8/16/32 x 512/1024 x 4/8 warps): 8 outputs x 1024 columns, 4 warps.
        _silu_and_mul_linear_kernel[(triton.cdiv(n, 8),)](
            x2, weight, out, x2.shape[0], n, inter, x2.stride(0), weight.stride(0),
            out.stride(0), BLOCK_M=next_pow2(x2.shape[0]), BLOCK_N=8,
            BLOCK_K=min(1024, next_pow2(inter)), num_warps=4, num_stages=3)
    return out.view(*x.shape[:-1], n)
