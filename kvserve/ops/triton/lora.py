"""Batched multi-LoRA kernels of the CUDA path (Triton): punica's shrink and expand, grouped by slot.

    lora_meta(token_slots [T], num_slots)  -> LoRAMeta: the tokens sorted by slot, per slot
                                              its count and start (device ops only)
    lora_shrink(x [T, K], a_stack [S, N, K], meta)          -> s [T, N] float32,
                                              s[t] = A[slot(t)] x[t]   (unset where slot(t) = -1)
                                              (small batches: [splits, T, N] partial sums)
    lora_expand(y [T, *], s [T, *], b_stack [S, N, R], meta, y_offset, s_offset)
                                              y[t, y_offset:+N] += B[slot(t)] s[t, s_offset:+R]

The grid is (blocks of BLOCK_M tokens x blocks of columns, slots): program (m, n, slot) takes
the m-th block of that slot's tokens (gathered through the sorted order) and exits at once
when the slot has fewer tokens, so one launch serves every adapter of the batch (SGMV; with
one token per adapter it is BGMV) and each adapter's A / B block is read once per token
block. A token without adapter (slot -1) is in no slot's group: its s row is never written
nor read (no zero-fill launch per layer) and its y row is never touched, and a slot without
tokens is never read (NaN there cannot leak).

CUDA-graph safe: the grid depends only on shapes (T, the stack sizes), never on the slot
values, and lora_meta is argsort / scatter_add / cumsum on the device, so nothing in the
LoRA path reads device data on the host. A fused layer (q/k/v, gate/up) may call lora_expand
once per slice with that slice's column offsets. A small batch's shrink is split along K (a
third grid axis, partial sums the expand adds in a fixed order: no atomics, the same bits
every run). Arithmetic: the shrink's 16-bit x and A go to the tensor cores (exact products,
float32 accumulation); float32 operands, the expand (float32 s against widened B) and
everything under Triton's interpreter (it mis-multiplies bf16 dots) use IEEE float32 dots.
On CPU the kernels run under Triton's interpreter (tests); the model uses them on CUDA only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from kvserve.ops.triton import interpreting

__all__ = ["LoRAMeta", "lora_meta", "lora_shrink", "lora_expand"]


@dataclass
class LoRAMeta:
    """The tokens of a batch grouped by slot (all device tensors of fixed shapes)."""
    sorted_tokens: torch.Tensor     # [T] int64: token indices, by slot (slot -1 last)
    counts: torch.Tensor            # [S + 1] int32: tokens per slot (the last: slot -1)
    starts: torch.Tensor            # [S + 1] int32: where each slot's tokens begin
    num_tokens: int
    num_slots: int


def lora_meta(token_slots: torch.Tensor, num_slots: int) -> LoRAMeta:
    """Group the tokens by slot; token_slots [T] int (-1: no adapter), on the kernels' device."""
    slots = token_slots.to(torch.int64)
    key = torch.where(slots < 0, torch.full_like(slots, num_slots), slots)
    sorted_tokens = torch.argsort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    return LoRAMeta(sorted_tokens, counts.to(torch.int32), starts.to(torch.int32),
                    int(slots.shape[0]), num_slots)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << max(0, (int(n) - 1).bit_length())))


def _block_m(num_tokens: int) -> int:
    # tl.dot needs 16 rows at least; prefill-size batches take larger blocks.
    return 16 if num_tokens <= 64 else 64


def _split_k(num_tokens: int, k: int, block_k: int) -> int:
    """Shrink programs per (token block, slot) along K. A decode batch has a few token blocks
    per slot, and one program walking all of K (768..8192) left most of the GPU idle: a
    128-token, 4-adapter step spent 5.1 ms in the 96 LoRA launches of a 110M model (H100).
    Each split covers >= 2 K tiles; prefill-size batches have blocks enough (no split)."""
    if triton.cdiv(num_tokens, _block_m(num_tokens)) >= 16:
        return 1
    return max(1, min(16, triton.cdiv(k, block_k) // 2))


def _dot_f32(*tensors: torch.Tensor) -> bool:
    """IEEE float32 products where an operand is float32 or under the interpreter (its bf16
    tl.dot is wrong); else the 16-bit operands go to the tensor cores as they are (float32
    accumulation), as vLLM's punica shrink does."""
    return interpreting() or any(t.dtype == torch.float32 for t in tensors)


@triton.jit
def _slot_block(tok_ptr, cnt_ptr, start_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's piece of work (axis 0: a block of BLOCK_M of its slot's tokens x a block
    of BLOCK_N columns; axis 1: the slot): whether the slot has no such block (the program is
    done), the slot, the tokens' rows and the columns, with their masks."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_blocks
    count = tl.load(cnt_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + tl.load(start_ptr + slot) + offs_m, mask=m_mask, other=0)
    offs_n = (pid % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_m * BLOCK_M >= count, slot, rows, m_mask, offs_n, offs_n < N


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, tok_ptr, cnt_ptr, start_ptr, N, K, K_PER_SPLIT,
                   sx_t, sx_k, sa_s, sa_n, sa_k, ss_split, ss_t, ss_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_F32: tl.constexpr):
    """s[split, t, :N] = x[t, K range of split] @ A[slot]^T for the BLOCK_M-th block of a
    slot's tokens (program axis 2: the split; the expand sums the splits)."""
    done, slot, rows, m_mask, offs_n, n_mask = _slot_block(tok_ptr, cnt_ptr, start_ptr, N,
                                                           BLOCK_M, BLOCK_N)
    if done:
        return
    a_base = a_ptr + slot.to(tl.int64) * sa_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    split = tl.program_id(2)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xb = tl.load(x_ptr + rows[:, None] * sx_t + offs_k[None, :] * sx_k,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        ab = tl.load(a_base + offs_n[None, :] * sa_n + offs_k[:, None] * sa_k,
                     mask=n_mask[None, :] & k_mask[:, None], other=0.0)       # [BK, BN] = A^T
        if DOT_F32:
            acc = tl.dot(xb.to(tl.float32), ab.to(tl.float32), acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(xb.to(ab.dtype), ab, acc=acc)
    s_ptrs = s_ptr + split.to(tl.int64) * ss_split + rows[:, None] * ss_t + offs_n[None, :] * ss_n
    tl.store(s_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, tok_ptr, cnt_ptr, start_ptr, N, R, SPLITS,
                   ss_split, ss_t, ss_r, sb_s, sb_n, sb_r, sy_t, sy_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[t, :N] += (sum over the splits of s[split, t, :R]) @ B[slot]^T for the BLOCK_M-th
    block of a slot's tokens; the splits are summed in order (the same bits every run). s
    stays float32 and B is widened (IEEE products): rounding s to bf16 for the tensor cores
    put a bf16 model's delta 1.9% off (of |y| + 1) on an H100, and the expand's dot is only
    rank-deep."""
    done, slot, rows, m_mask, offs_n, n_mask = _slot_block(tok_ptr, cnt_ptr, start_ptr, N,
                                                           BLOCK_M, BLOCK_N)
    if done:
        return
    b_base = b_ptr + slot.to(tl.int64) * sb_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        s_mask = m_mask[:, None] & r_mask[None, :]
        sb = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for sp in range(0, SPLITS):
            sb += tl.load(s_ptr + sp * ss_split + rows[:, None] * ss_t + offs_r[None, :] * ss_r,
                          mask=s_mask, other=0.0)
        bb = tl.load(b_base + offs_n[None, :] * sb_n + offs_r[:, None] * sb_r,
                     mask=n_mask[None, :] & r_mask[:, None], other=0.0)       # [BR, BN] = B^T
        acc = tl.dot(sb, bb.to(tl.float32), acc=acc, input_precision="ieee")
    y_ptrs = y_ptr + rows[:, None] * sy_t + offs_n[None, :] * sy_n
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _check(what: str, x: torch.Tensor, stack: torch.Tensor, meta: LoRAMeta) -> None:
    if x.dim() != 2 or stack.dim() != 3:
        raise ValueError(f"{what}: expected a 2-D input and a 3-D [slots, N, K] stack, got "
                         f"{tuple(x.shape)} and {tuple(stack.shape)}")
    if x.shape[0] != meta.num_tokens or stack.shape[0] != meta.num_slots:
        raise ValueError(f"{what}: {x.shape[0]} tokens and {stack.shape[0]} slots, the "
                         f"mapping has {meta.num_tokens} and {meta.num_slots}")


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, meta: LoRAMeta,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s = per token x[t] @ a_stack[slot(t)]^T in float32: [T, N], or [splits, T, N] partial
    sums over K ranges when the batch is small (_split_k; lora_expand sums them). The rows of
    slot -1 are left as they were (lora_expand never reads them). `out` ([T, >= N] float32)
    is written instead of a new tensor (no split)."""
    _check("lora_shrink", x, a_stack, meta)
    T, K = x.shape
    N = a_stack.shape[1]
    if a_stack.shape[2] != K:
        raise ValueError(f"lora_shrink: x has {K} columns, A {a_stack.shape[2]}")
    bm, bn, bk = _block_m(T), _pow2(N, 16, 64), _pow2(K, 16, 64)
    splits = 1 if out is not None else _split_k(T, K, bk)
    if out is not None:
        s = out
    elif splits == 1:
        s = torch.empty(T, N, dtype=torch.float32, device=x.device)
    else:
        s = torch.empty(splits, T, N, dtype=torch.float32, device=x.device)
    if T == 0 or N == 0:
        return s
    s3 = s if s.dim() == 3 else s.unsqueeze(0)
    per_split = triton.cdiv(triton.cdiv(K, bk), splits) * bk
    grid = (triton.cdiv(T, bm) * triton.cdiv(N, bn), meta.num_slots, splits)
    _shrink_kernel[grid](x, a_stack, s3, meta.sorted_tokens, meta.counts, meta.starts, N, K,
                         per_split, x.stride(0), x.stride(1), a_stack.stride(0),
                         a_stack.stride(1), a_stack.stride(2), s3.stride(0), s3.stride(1),
                         s3.stride(2), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                         DOT_F32=_dot_f32(x, a_stack))
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, b_stack: torch.Tensor, meta: LoRAMeta,
                y_offset: int = 0, s_offset: int = 0) -> torch.Tensor:
    """In place: y[t, y_offset:y_offset+N] += s[t, s_offset:s_offset+R] @ b_stack[slot(t)]^T
    for every token with a slot; b_stack [S, N, R] (may be a strided view of a wider stack);
    s [T, *] or lora_shrink's [splits, T, *] partial sums (summed here)."""
    _check("lora_expand", y, b_stack, meta)
    T = y.shape[0]
    N, R = b_stack.shape[1], b_stack.shape[2]
    s3 = s if s.dim() == 3 else s.unsqueeze(0)
    if y_offset + N > y.shape[1] or s_offset + R > s3.shape[2] or s3.shape[1] != T:
        raise ValueError(f"lora_expand: B [{N}, {R}] at columns {y_offset} of y "
                         f"{tuple(y.shape)} and {s_offset} of s {tuple(s.shape)} do not fit")
    if T == 0 or N == 0 or R == 0:
        return y
    bm, bn, br = _block_m(T), _pow2(N, 16, 64), _pow2(R, 16, 64)
    grid = (triton.cdiv(T, bm) * triton.cdiv(N, bn), meta.num_slots)
    s_view, y_view = s3[:, :, s_offset:], y[:, y_offset:]
    _expand_kernel[grid](s_view, b_stack, y_view, meta.sorted_tokens, meta.counts,
                         meta.starts, N, R, s3.shape[0], s_view.stride(0), s_view.stride(1),
                         s_view.stride(2), b_stack.stride(0), b_stack.stride(1),
                         b_stack.stride(2), y_view.stride(0), y_view.stride(1),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br)
    return y
