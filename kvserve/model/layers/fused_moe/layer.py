"""FusedMoE: a mixture-of-experts layer's experts, stacked, tensor-parallel (vLLM's name).

Weights are stored stacked: w13_weight [E, 2*I_r, H] (each expert's gate rows, then its up
rows) and w2_weight [E, H, I_r], where I_r = intermediate_size / tp_size: every rank holds a
slice of EVERY expert's intermediate dimension (the way the dense MLP is split), computes a
partial sum of the down projection, and the ranks all-reduce it. Checkpoints name each expert's
matrices separately (Mixtral w1 / w3 / w2, Qwen gate_proj / up_proj / down_proj); the weight
loader takes shard_id = (expert, "w1" | "w3" | "w2") and copies this rank's slice.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from kvserve.distributed.parallel_state import (get_tp_rank, get_tp_world_size,
                                                tensor_model_parallel_all_reduce)
from kvserve.model.layers.fused_moe.fused_moe import fused_experts
from kvserve.model.layers.fused_moe.routing import select_experts
from kvserve.model.layers.linear import copy_checked, divide, shard

ExpertShard = tuple[int, str]       # (expert id, "w1" gate | "w3" up | "w2" down)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size                  # the full, per expert
        self.shard_size = divide(intermediate_size, self.tp_size)  # this rank's
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.shard_size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard_size),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str, ExpertShard]] = None) -> None:
        """Copy this rank's slice of one expert's checkpoint matrix: w1 / w3 [I, H] into the
        gate / up half of w13_weight[expert], w2 [H, I] into w2_weight[expert]."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2
                and shard_id[1] in ("w1", "w2", "w3")):
            raise ValueError(f"FusedMoE needs shard_id (expert, 'w1'|'w2'|'w3'), got {shard_id!r}.")
        expert, which = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Expert {expert} is out of range: the config has "
                             f"{self.num_experts} experts.")
        n, full = self.shard_size, self.intermediate_size
        if which == "w2":
            if param is not self.w2_weight:
                raise ValueError("a down projection (w2) goes into w2_weight")
            copy_checked(param.data[expert], shard(loaded_weight, 1, full, self.tp_rank, n))
            return
        if param is not self.w13_weight:
            raise ValueError("gate / up projections (w1 / w3) go into w13_weight")
        offset = 0 if which == "w1" else n
        copy_checked(param.data[expert].narrow(0, offset, n),
                     shard(loaded_weight, 0, full, self.tp_rank, n))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, E] -> [T, H] (summed over the TP ranks
        unless reduce_results is False: then this rank's partial sum)."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                            topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size} (this rank {self.shard_size}), "
                f"renormalize={self.renormalize}, tp_size={self.tp_size}")
