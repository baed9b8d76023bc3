"""Batched multi-LoRA kernels of the CUDA path (Triton): punica's shrink and expand, grouped by slot.

    lora_meta(token_slots [T], num_slots)  -> LoRAMeta: the tokens sorted by slot, per slot
                                              its count and start (device ops only)
    lora_shrink(x [T, K], a_stack [S, N, K], meta)          -> s [T, N] float32,
                                              s[t] = A[slot(t)] x[t]   (unset where slot(t) = -1)
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
once per slice with that slice's column offsets. Arithmetic: operands widened to float32 and
multiplied with IEEE precision (no TF32): the rank is small, so the kernels are bound by
reading A and B, not by the dot (and Triton's interpreter mis-multiplies bf16 dots).
On CPU the kernels run under Triton's interpreter (tests); the model uses them on CUDA only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

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


@triton.jit
def _grouped_kernel(in_ptr, w_ptr, out_ptr, tok_ptr, cnt_ptr, start_ptr, N, K,
                    si_t, si_k, sw_s, sw_n, sw_k, so_t, so_n,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ACCUMULATE: tl.constexpr):
    """out[t, :N] (= or +=) in[t, :K] @ W[slot]^T for the BLOCK_M-th block of a slot's tokens:
    shrink (in = x, W = A, stored) and expand (in = s, W = B, added) are this one kernel."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks
    count = tl.load(cnt_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(start_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(tok_ptr + start + offs_m, mask=m_mask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + slot.to(tl.int64) * sw_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        ib = tl.load(in_ptr + rows[:, None] * si_t + offs_k[None, :] * si_k,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wb = tl.load(w_base + offs_n[None, :] * sw_n + offs_k[:, None] * sw_k,
                     mask=n_mask[None, :] & k_mask[:, None], other=0.0)       # [BK, BN] = W^T
        acc = tl.dot(ib.to(tl.float32), wb.to(tl.float32), acc=acc, input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None] * so_t + offs_n[None, :] * so_n
    mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        out = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (out.to(tl.float32) + acc).to(out.dtype), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


def _check(what: str, x: torch.Tensor, stack: torch.Tensor, meta: LoRAMeta) -> None:
    if x.dim() != 2 or stack.dim() != 3:
        raise ValueError(f"{what}: expected a 2-D input and a 3-D [slots, N, K] stack, got "
                         f"{tuple(x.shape)} and {tuple(stack.shape)}")
    if x.shape[0] != meta.num_tokens or stack.shape[0] != meta.num_slots:
        raise ValueError(f"{what}: {x.shape[0]} tokens and {stack.shape[0]} slots, the "
                         f"mapping has {meta.num_tokens} and {meta.num_slots}")


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, meta: LoRAMeta,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s [T, N] float32 = per token x[t] @ a_stack[slot(t)]^T; the rows of slot -1 are left
    as they were (lora_expand never reads them). `out` ([T, >= N] float32) is written instead
    of a new tensor."""
    _check("lora_shrink", x, a_stack, meta)
    T, K = x.shape
    N = a_stack.shape[1]
    if a_stack.shape[2] != K:
        raise ValueError(f"lora_shrink: x has {K} columns, A {a_stack.shape[2]}")
    s = torch.empty(T, N, dtype=torch.float32, device=x.device) if out is None else out
    if T == 0 or N == 0:
        return s
    bm, bn, bk = _block_m(T), _pow2(N, 16, 64), _pow2(K, 16, 64)
    grid = (triton.cdiv(T, bm) * triton.cdiv(N, bn), meta.num_slots)
    _grouped_kernel[grid](x, a_stack, s, meta.sorted_tokens, meta.counts, meta.starts, N, K,
                          x.stride(0), x.stride(1), a_stack.stride(0), a_stack.stride(1),
                          a_stack.stride(2), s.stride(0), s.stride(1),
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ACCUMULATE=False)
    return s


def lora_expand(y: torch.Tensor, s: torch.Tensor, b_stack: torch.Tensor, meta: LoRAMeta,
                y_offset: int = 0, s_offset: int = 0) -> torch.Tensor:
    """In place: y[t, y_offset:y_offset+N] += s[t, s_offset:s_offset+R] @ b_stack[slot(t)]^T
    for every token with a slot; b_stack [S, N, R] (may be a strided view of a wider stack)."""
    _check("lora_expand", y, b_stack, meta)
    T = y.shape[0]
    N, R = b_stack.shape[1], b_stack.shape[2]
    if y_offset + N > y.shape[1] or s_offset + R > s.shape[1] or s.shape[0] != T:
        raise ValueError(f"lora_expand: B [{N}, {R}] at columns {y_offset} of y "
                         f"{tuple(y.shape)} and {s_offset} of s {tuple(s.shape)} do not fit")
    if T == 0 or N == 0 or R == 0:
        return y
    bm, bn, br = _block_m(T), _pow2(N, 16, 64), _pow2(R, 16, 64)
    grid = (triton.cdiv(T, bm) * triton.cdiv(N, bn), meta.num_slots)
    s_view, y_view = s[:, s_offset:], y[:, y_offset:]
    _grouped_kernel[grid](s_view, b_stack, y_view, meta.sorted_tokens, meta.counts,
                          meta.starts, N, R, s_view.stride(0), s_view.stride(1),
                          b_stack.stride(0), b_stack.stride(1), b_stack.stride(2),
                          y_view.stride(0), y_view.stride(1),
                          BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=br, ACCUMULATE=True)
    return y
