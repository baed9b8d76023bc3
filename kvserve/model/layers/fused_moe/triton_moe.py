"""The CUDA path's fused experts (Triton), after vLLM's `fused_moe`: tokens sorted by expert.

    1. moe_align_block_size: the T * k (token, expert) pairs sorted by expert and each expert's
       run padded to a multiple of BLOCK_M, so every block of BLOCK_M sorted rows belongs to
       one expert (expert_ids[block]); padding rows hold the index num_pairs (masked out);
    2. one tiled GEMM kernel over (block, N tile): rows of A gathered through the sorted pair
       ids, B = that block's expert's weight, tl.dot over K tiles, float32 accumulation,
       rows scattered back to their pair's row of C; for w13 (A = x, row = pair // k) and for
       w2 (A = the activation, row = pair) with the routing weight multiplied in;
    3. SiLU * up between them (ops.fused.silu_and_mul), the k rows of each token summed after.

No host synchronisation anywhere (CUDA-graph safe): the sort, counts and block map are
device ops into buffers of a size known from the shapes alone (the worst-case padding),
and blocks past the padded total return at once (num_tokens_post_padded read on the device).
Tested on CPU under Triton's interpreter against float64; the model uses it for CUDA tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.ops.fused import silu_and_mul

BLOCK_M = 16          # sorted rows per block (tl.dot needs >= 16)
BLOCK_N = 64
BLOCK_K = 32


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [max_padded] int32: pair indices (token * k + slot)
    sorted by expert, each expert's run padded to a multiple of block_m with the value T * k;
    expert_ids [max_padded / block_m] int32: each block's expert; num_post_padded [1] int32:
    the padded total, blocks at or past it hold nothing). max_padded = the worst case,
    T * k + E * (block_m - 1) rounded up to block_m, so no size depends on the data."""
    flat = topk_ids.reshape(-1).long()
    pairs, device = flat.numel(), flat.device
    max_padded = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    # scatter_add, not bincount: bincount sizes its output from the data (a host sync).
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=device) - first_of_expert[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    sorted_ids = torch.full((max_padded,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), ends[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                     num_post_padded_ptr, N, K, num_pairs, stride_am, stride_be, stride_bn,
                     stride_bk, stride_cm, TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """C[pair, n] = (A[pair // TOP_K] . B[expert, n]) (* weights[pair]) for the BLOCK_M sorted
    pairs of block program_id(0) and the BLOCK_N columns of program_id(1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (pair // TOP_K)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_rows + kk[None, :], mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(b_cols + kk[:, None] * stride_bk,
                    mask=(kk[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        if IEEE:    # float32 math: no TF32 (float32 models; 16-bit on the interpreter)
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=valid, other=0.0)
        acc = acc * w[:, None]
    c = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _moe_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor,
              sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post: torch.Tensor,
              top_k: int, mul_weight: bool) -> None:
    """c [pairs, N] = rows of a against each pair's expert of b [E, N, K] (see the kernel)."""
    n, k = b.shape[1], b.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(n, BLOCK_N))
    _moe_gemm_kernel[grid](a, b, c, weights, sorted_ids, expert_ids, num_post, n, k, c.shape[0],
                           a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
                           TOP_K=top_k, MUL_WEIGHT=mul_weight,
                           # Triton's CPU interpreter multiplies 16-bit tiles wrongly: widen.
                           IEEE=a.dtype == torch.float32 or not a.is_cuda,
                           BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def fused_experts_triton(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H]; w13 [E, 2I, H] (gate | up), w2 [E, H, I]; topk_weights /
    topk_ids [T, k] -> [T, H] = sum over k of weight * down(silu(gate x) * up x)."""
    num_tokens, hidden = hidden_states.shape
    top_k, inter = topk_ids.shape[1], w2.shape[2]
    pairs = num_tokens * top_k
    x = hidden_states.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, BLOCK_M, w13.shape[0])
    gate_up = torch.empty(pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, gate_up, weights, sorted_ids, expert_ids, num_post, top_k, False)
    act = silu_and_mul(gate_up)
    rows = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(act, w2, rows, weights, sorted_ids, expert_ids, num_post, 1, True)
    return rows.view(num_tokens, top_k, hidden).sum(dim=1)
