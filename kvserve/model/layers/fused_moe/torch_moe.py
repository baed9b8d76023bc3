"""The experts' computation in torch ops (every device; the reference for faster kernels).

Tokens are grouped by expert: the T*k (token, expert) pairs are sorted by expert id (a stable
sort, so within an expert the tokens keep their order), each expert that received tokens runs
one gate_up GEMM -> SiLU * up -> down GEMM over its rows, the rows are scaled by their routing
weights, and one index_add_ sums every token's k rows back. Only the routed experts' weights
are read; the Python loop is over the experts that have tokens (vLLM's CPU fallback does the
same), never over tokens.
"""
from __future__ import annotations

import torch

from kvserve.ops.fused import silu_and_mul


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
        w13e, w2e = w13[expert].to(x.dtype), w2[expert].to(x.dtype)
        act = silu_and_mul(torch.mm(x[seg], w13e.t()))
        torch.mm(act, w2e.t(), out=rows[seg])
        start += n
    rows.mul_(weights.unsqueeze(1))
    out = torch.zeros(num_tokens, hidden, dtype=hidden_states.dtype, device=x.device)
    return out.index_add_(0, token_of, rows)
