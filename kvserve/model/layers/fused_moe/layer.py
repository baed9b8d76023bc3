"""FusedMoE: a mixture-of-experts layer's experts, stacked, tensor-parallel (vLLM's name).

Weights are stored stacked: w13_weight [E, 2*I_r, H] (each expert's gate rows, then its up
rows) and w2_weight [E, H, I_r], where I_r = intermediate_size / tp_size: every rank holds a
slice of EVERY expert's intermediate dimension (the way the dense MLP is split), computes a
partial sum of the down projection, and the ranks all-reduce it. Checkpoints name each expert's
matrices separately (Mixtral w1 / w3 / w2, Qwen gate_proj / up_proj / down_proj); the weight
loader takes shard_id = (expert, "w1" | "w3" | "w2") and copies this rank's slice.

Expert parallelism (--enable-expert-parallel, ep_size = tp_size): rank r instead holds experts
[r*E/N, (r+1)*E/N) whole (w13_weight [E/N, 2I, H]); the others' checkpoint tensors are never
read (MoEForCausalLM.checkpoint_skip). Tokens reach their experts' ranks and come back by the
collective TP already uses: every TP rank holds every token's hidden states (activations are
replicated), so each rank runs its local experts for all tokens routed to them -- the router is
replicated, `expert_map` turns global ids into local ones and other ranks' into -1, which the
kernel skips -- and the all-reduce that sums TP's partial products sums the ranks' experts
instead. vLLM's naive EP path does the same; its all-to-all dispatch pays off only with
data-parallel attention, where each rank holds different tokens, which kvserve does not have.

On a CPU with AVX-512 BF16, bf16 experts under bf16 math are re-laid out once at load into
16-row panels (choose_cpu_layout; ops/moe.py pack_panels): the C++ kernel's operand order, for
prefill and decode steps alike. The values are the same; only the stacks' shapes change.

GGUF experts of a block type ops.quant packs arrive as raw blocks (ops.quant.QuantizedRows):
the loader records them, leaves the float Parameter empty ([E, 0, 0]: no float copy is ever
made), and process_weights_after_loading packs each projection into one PackedExperts stack
(packed.py); forward then runs fused_experts_packed. A projection of a float type keeps its
float stack beside the packed ones.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from kvserve.distributed.parallel_state import (get_ep_rank, get_ep_world_size, get_tp_rank,
                                                get_tp_world_size,
                                                tensor_model_parallel_all_reduce)
from kvserve.model.layers.fused_moe.fused_moe import fused_experts
from kvserve.model.layers.fused_moe.packed import (ExpertStack, PackedExperts,
                                                   fused_experts_packed)
from kvserve.model.layers.fused_moe.routing import select_experts
from kvserve.model.layers.fused_moe.torch_moe import fused_experts_torch
from kvserve.model.layers.linear import copy_checked, divide, shard
from kvserve.ops import moe as moe_ops
from kvserve.ops.quant.weight import QuantizedRows

ExpertShard = tuple[int, str]       # (expert id, "w1" gate | "w3" up | "w2" down)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True,
                 ep_rank: Optional[int] = None, ep_size: Optional[int] = None) -> None:
        """ep_rank / ep_size: this rank's expert-parallel place (default: parallel_state's,
        rank 0 of 1 without --enable-expert-parallel)."""
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_world_size()
        self.ep_rank = get_ep_rank() if ep_rank is None else ep_rank
        self.ep_size = get_ep_world_size() if ep_size is None else ep_size
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size                  # the full, per expert
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        if self.ep_size > 1:
            if num_experts % self.ep_size:
                raise ValueError(f"Expert parallelism: {num_experts} experts cannot be split "
                                 f"evenly over {self.ep_size} ranks.")
            self.local_num_experts = num_experts // self.ep_size
            self.expert_start = self.ep_rank * self.local_num_experts
            self.shard_size, self.slice_rank = intermediate_size, 0        # whole experts
        else:
            self.local_num_experts, self.expert_start = num_experts, 0
            self.shard_size = divide(intermediate_size, self.tp_size)     # this rank's slice
            self.slice_rank = self.tp_rank
        # Global expert id -> this rank's index, -1 for another rank's (vLLM's expert_map).
        expert_map = torch.full((num_experts,), -1, dtype=torch.int64)
        expert_map[self.expert_start:self.expert_start + self.local_num_experts] = \
            torch.arange(self.local_num_experts)
        self.register_buffer("expert_map", expert_map, persistent=False)
        self.w13_weight = nn.Parameter(
            torch.empty(self.local_num_experts, 2 * self.shard_size, hidden_size),
            requires_grad=False)
        self.w2_weight = nn.Parameter(
            torch.empty(self.local_num_experts, hidden_size, self.shard_size),
            requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # bf16 experts stay bf16 under float32 math (dtype "auto" on a CPU without bf16
        # instructions, built in the checkpoint's dtype): the decode kernel reads them as they
        # are (half the bytes per step), the grouped GEMMs widen one expert at a time. Exact:
        # the widened values are the same numbers. float16 experts are widened at load (the
        # kernel has no float16 path).
        keep = self.w13_weight.dtype == torch.bfloat16
        self.w13_weight.keep_loaded_dtype = self.w2_weight.keep_loaded_dtype = keep
        # GGUF blocks kept packed: (local expert, "w1" | "w3" | "w2") -> this rank's rows,
        # until process_weights_after_loading stacks them; then the stacks (module doc).
        self._quant_parts: dict[ExpertShard, QuantizedRows] = {}
        self._float_loaded: set[str] = set()        # "w13" / "w2": float experts copied
        self.w13_packed: Optional[list[PackedExperts]] = None    # [gate|up] or [gate, up]
        self.w2_packed: Optional[PackedExperts] = None

    def is_local_expert(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.local_num_experts

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str, ExpertShard]] = None) -> bool:
        """Copy this rank's slice of one expert's checkpoint matrix: w1 / w3 [I, H] into the
        gate / up half of w13_weight[expert], w2 [H, I] into w2_weight[expert]. Returns False
        (nothing copied) for another expert-parallel rank's expert."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2
                and shard_id[1] in ("w1", "w2", "w3")):
            raise ValueError(f"FusedMoE needs shard_id (expert, 'w1'|'w2'|'w3'), got {shard_id!r}.")
        expert, which = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Expert {expert} is out of range: the config has "
                             f"{self.num_experts} experts.")
        if not self.is_local_expert(expert):
            return False
        local = expert - self.expert_start
        n, full = self.shard_size, self.intermediate_size
        if (param is self.w2_weight) != (which == "w2"):
            raise ValueError("a down projection (w2) goes into w2_weight, gate / up "
                             "projections (w1 / w3) into w13_weight")
        piece = shard(loaded_weight, 1 if which == "w2" else 0, full, self.slice_rank, n)
        if isinstance(piece, QuantizedRows):
            self._record_packed(param, local, which, piece)
            return True
        kind = "w2" if which == "w2" else "w13"
        if any(w in (("w2",) if kind == "w2" else ("w1", "w3")) for _, w in self._quant_parts):
            raise ValueError(f"expert {expert} {which}: a float tensor where the other experts' "
                             f"{kind} stay packed")
        self._float_loaded.add(kind)
        dst = param.data[local] if which == "w2" else \
            param.data[local].narrow(0, 0 if which == "w1" else n, n)
        copy_checked(dst, piece)
        return True

    def _record_packed(self, param: nn.Parameter, local: int, which: str,
                       piece: QuantizedRows) -> None:
        """Keep one expert's GGUF blocks (this rank's rows) for process_weights_after_loading;
        the float Parameter is emptied on the first (never allocated in full)."""
        want = (self.hidden_size, self.shard_size) if which == "w2" else \
            (self.shard_size, self.hidden_size)
        if tuple(piece.shape) != want:
            raise ValueError(f"Checkpoint tensor shape {tuple(piece.shape)} does not match the "
                             f"expert {which} (shard) shape {want}.")
        if ("w2" if which == "w2" else "w13") in self._float_loaded:
            raise ValueError(f"expert {which}: packed blocks where other experts were float")
        if param.numel():
            param.data = torch.empty(self.local_num_experts, 0, 0, dtype=param.dtype)
        self._quant_parts[(local, which)] = piece

    @property
    def packed(self) -> bool:
        """Whether some projection's experts are GGUF blocks kept packed (loaded or loading)."""
        return bool(self._quant_parts) or self.w2_packed is not None \
            or self.w13_packed is not None

    def choose_cpu_layout(self, act_dtype: torch.dtype) -> None:
        """bf16 experts with bf16 math on a CPU with AVX-512 BF16: kept panel-packed
        (ops/moe.py pack_panels), the C++ kernel's layout for every step size; the stacks'
        shapes become w13 [E, 2I/16, H/2, 32], w2 [E, H/16, I/2, 32]. Not with expert
        parallelism (its -1 ids go to the grouped torch path) or GGUF experts."""
        if self.ep_size > 1 or self.packed or not moe_ops.panels_fit(
                self.w13_weight, self.w2_weight, act_dtype):
            return
        self.w13_weight.data, self.w2_weight.data = moe_ops.pack_panels(
            self.w13_weight.data, self.w2_weight.data)

    def process_weights_after_loading(self) -> None:
        """Stack the recorded GGUF blocks per projection (gate and up fused when of one
        type). Where experts are packed, each expert's gate, up and down must all be there."""
        parts, self._quant_parts = self._quant_parts, {}
        if not parts:
            return
        local = range(self.local_num_experts)
        for which in sorted({w for _, w in parts}):
            missing = [e + self.expert_start for e in local if (e, which) not in parts]
            if missing:
                raise ValueError(f"packed experts: no {which} blocks for experts {missing}")
        if (0, "w1") in parts:
            if parts[(0, "w1")].qtype == parts[(0, "w3")].qtype:
                self.w13_packed = [PackedExperts.stack([[parts[(e, "w1")], parts[(e, "w3")]]
                                                        for e in local])]
            else:               # two types: two stacks, two int8 calls per expert
                self.w13_packed = [PackedExperts.stack([[parts[(e, w)]] for e in local])
                                   for w in ("w1", "w3")]
        if (0, "w2") in parts:
            self.w2_packed = PackedExperts.stack([[parts[(e, "w2")]] for e in local])

    def expert_stacks(self) -> tuple[list[ExpertStack], ExpertStack]:
        """(w13 stacks, w2 stack) for fused_experts_packed: packed where kept so, else the
        float Parameters."""
        return (self.w13_packed or [self.w13_weight],
                self.w2_packed if self.w2_packed is not None else self.w2_weight)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H], router_logits [T, E] -> [T, H] (summed over the TP ranks
        unless reduce_results is False: then this rank's partial sum)."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.packed:
            if self.ep_size > 1:
                topk_ids = self.expert_map[topk_ids]     # -1: skipped, as below
            w13, w2 = self.expert_stacks()
            out = fused_experts_packed(hidden_states, w13, w2, topk_weights, topk_ids,
                                       self.local_num_experts, ids_in_range=self.ep_size == 1)
        elif self.ep_size > 1:
            # Local ids; -1 marks another rank's expert, which only the grouped torch path
            # skips (the C++ and Triton kernels take ids in [0, E)).
            topk_ids = self.expert_map[topk_ids]
            out = fused_experts_torch(hidden_states, self.w13_weight, self.w2_weight,
                                      topk_weights, topk_ids)
        else:
            out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights,
                                topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size} (this rank {self.shard_size}), "
                f"renormalize={self.renormalize}, tp_size={self.tp_size}, "
                f"ep: experts [{self.expert_start}, "
                f"{self.expert_start + self.local_num_experts}) of {self.ep_size} ranks"
                + (f", packed {self.w13_packed} {self.w2_packed}" if self.packed else ""))
