"""The experts' computation in torch ops (every device; the reference for faster kernels).

Tokens are grouped by expert: the T*k (token, expert) pairs are sorted by expert id (a stable
sort, so within an expert the tokens keep their order), each expert that received tokens runs
one gate_up GEMM -> SiLU * up -> down GEMM over its rows, the rows are scaled by their routing
weights, and one index_add_ sums every token's k rows back. Only the routed experts' weights
are read; the Python loop is over the experts that have tokens (vLLM's CPU fallback does the
same), never over tokens.
"""
from __future__ import annotations

import threading

import torch

from kvserve.ops.fused import silu_and_mul
from kvserve.ops.linear import mm_t


def group_by_expert(topk_ids: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """topk_ids [T, k] -> (order: the flat (token, slot) pairs sorted by expert, token_of:
    the token each sorted pair belongs to, counts [E]: pairs per expert). Pairs with id -1
    (an expert on another expert-parallel rank) sort first and are left out."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()
    if counts[0]:
        order = order[counts[0]:]
    return order, order // topk_ids.shape[1], counts[1:]


_scratch = threading.local()


def widened(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's 16-bit weight in `dtype`, written into a buffer this thread reuses (valid
    until its next call with that shape). `w.to(dtype)` allocates a fresh 8 MB (a 1024 x 2048
    gate_up) per expert per step, page-faulted anew each time (glibc hands such blocks back to
    the OS): the conversion took 2.4 ms instead of 1.3 (one Zen 3 thread)."""
    if w.dtype == dtype:
        return w
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    key = (tuple(w.shape), dtype, w.device)
    buf = bufs.get(key)
    if buf is None:
        buf = bufs[key] = torch.empty(w.shape, dtype=dtype, device=w.device)
    return buf.copy_(w)


def fused_experts_torch(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H]; w13 [E, 2I, H] (gate | up), w2 [E, H, I]; topk_weights /
    topk_ids [T, k] -> [T, H] = sum over k of weight * down(silu(gate x) * up x), the pairs
    whose id is -1 left out (expert parallelism: another rank's expert)."""
    num_tokens, hidden = hidden_states.shape
    order, token_of, counts = group_by_expert(topk_ids, w13.shape[0])
    x = hidden_states.index_select(0, token_of)
    # Weights in the activations' dtype: float32 math stays float32, 16-bit stays 16-bit.
    weights = topk_weights.reshape(-1).index_select(0, order).to(hidden_states.dtype)
    rows = torch.empty(x.shape[0], hidden, dtype=hidden_states.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        seg = slice(start, start + n)
        # bf16 experts with float32 x (layer.py keeps them 16-bit): widened per expert.
        w13e, w2e = widened(w13[expert], x.dtype), widened(w2[expert], x.dtype)
        act = silu_and_mul(mm_t(x[seg], w13e))
        mm_t(act, w2e, out=rows[seg])
        start += n
    rows.mul_(weights.unsqueeze(1))
    out = torch.zeros(num_tokens, hidden, dtype=hidden_states.dtype, device=x.device)
    return out.index_add_(0, token_of, rows)
