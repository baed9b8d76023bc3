"""Router top-k: which experts each token goes to, and with what weight (vLLM's
`FusedMoE.select_experts`).

Both families take a float32 softmax over ALL experts' logits, then the top-k of it:
  - Mixtral renormalises the k weights to sum to 1 -- the same numbers as a softmax over the
    top-k logits alone (vLLM: renormalize=True);
  - Qwen2-MoE / Qwen3-MoE renormalise only when the config's `norm_topk_prob` is set.
The top-k is torch.topk, as in transformers, so ties pick the same experts.
"""
from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, k], topk_ids int64 [T, k])."""
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}].")
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
