"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention, norms, the stack and the LM head are llama.py's; only the feed-forward block
differs (LlamaDecoderLayer.build_mlp): a router (`gate`, replicated) picks top-k experts per
token and FusedMoE (layers/fused_moe) runs them. Qwen2-MoE adds an always-on shared expert
scaled by sigmoid(shared_expert_gate(x)); Qwen configs may keep some layers dense
(`mlp_only_layers`, `decoder_sparse_step`).

With --enable-expert-parallel each TP rank holds E/N whole experts (layers/fused_moe/layer.py)
and `checkpoint_skip` keeps the loader from reading the other ranks' expert tensors (GGUF
files' stacked experts are split per expert by gguf.py, so the same skip applies).

Small steps (<= 8 tokens) run all layers in the C++ decode op (fused_decode.py), whose MLP part
calls the router, the same routing ops and the fused MoE kernel for these blocks.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.distributed.parallel_state import get_ep_rank, get_ep_world_size
from kvserve.model.layers.fused_moe import FusedMoE
from kvserve.model.layers.linear import ReplicatedLinear
from kvserve.model.llama import (DecoderFlags, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                 Qwen3ForCausalLM)

# "<prefix>.experts.<e>.<projection>.weight": one expert's matrix in an HF checkpoint.
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def _require(hf: dict, key: str, arch: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arch}: config.json needs a positive integer {key!r} (got {value!r}).")
    return value


class MixtralMoE(nn.Module):
    """Router + experts; the top-k weights always renormalised (softmax over the top-k)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf, arch = config.hf_config, "MixtralForCausalLM"
        num_experts = _require(hf, "num_local_experts", arch)
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, _require(hf, "num_experts_per_tok", arch),
                                config.hidden_size, _require(hf, "intermediate_size", arch),
                                renormalize=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class QwenMoE(nn.Module):
    """Qwen2-MoE / Qwen3-MoE sparse block: renormalised top-k only with `norm_topk_prob`;
    Qwen2-MoE's shared expert where `shared_expert_intermediate_size` is set."""

    def __init__(self, config: ModelConfig, arch: str) -> None:
        super().__init__()
        hf, hidden = config.hf_config, config.hidden_size
        # Hub configs say num_experts; transformers >= 5 writes num_local_experts.
        num_experts = _require(hf, "num_experts" if "num_experts" in hf else "num_local_experts",
                               arch)
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, _require(hf, "num_experts_per_tok", arch), hidden,
                                _require(hf, "moe_intermediate_size", arch),
                                renormalize=bool(hf.get("norm_topk_prob", False)))
        # Qwen3-MoE has no shared expert, whatever its config.json carries.
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        if shared > 0 and arch == "Qwen2MoeForCausalLM":
            self.shared_expert = LlamaMLP(hidden, shared, bias=False)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden_states))
            out = out + gate * self.shared_expert(hidden_states)
        return out


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: ModelConfig, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        return MixtralMoE(config)


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config: ModelConfig, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        hf = config.hf_config
        step = int(hf.get("decoder_sparse_step") or 1)
        num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        sparse = (layer_idx not in (hf.get("mlp_only_layers") or [])
                  and num_experts > 0 and (layer_idx + 1) % step == 0)
        if sparse:
            return QwenMoE(config, config.architecture)
        return LlamaMLP(config.hidden_size, int(hf["intermediate_size"]), flags.mlp_bias)


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family model whose layers' experts load from per-expert checkpoint tensors."""

    # Checkpoint projection name -> FusedMoE shard ("w1" gate, "w3" up, "w2" down).
    expert_projections: dict[str, str] = {}
    # Checkpoint module-name part -> ours (Mixtral's block_sparse_moe is our mlp).
    renamed_modules: dict[str, str] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors go to their FusedMoE (loaded once every expert's gate / up / down
        has been seen); everything else to LlamaForCausalLM.load_weights."""
        params = dict(self.named_parameters())
        seen: dict[str, set] = defaultdict(set)

        def dense_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                for old, new in self.renamed_modules.items():
                    name = name.replace(f".{old}.", f".{new}.")
                match = _EXPERT_TENSOR.match(name)
                if match is None:
                    yield name, tensor
                    continue
                if name.startswith(self._missing):      # another pipeline stage's layer
                    continue
                prefix, expert, proj = match.groups()
                which = self.expert_projections.get(proj)
                param_name = f"{prefix}.{'w2_weight' if which == 'w2' else 'w13_weight'}"
                param = params.get(param_name)
                if which is None or param is None:
                    raise ValueError(f"Checkpoint tensor {name!r} matches no parameter of "
                                     f"{type(self).__name__} (is config.json right for this "
                                     f"checkpoint?).")
                try:
                    copied = param.weight_loader(param, tensor, (int(expert), which))
                except ValueError as e:
                    raise ValueError(f"Loading checkpoint tensor {name!r}: {e}") from None
                if copied:           # False: another expert-parallel rank's expert
                    seen[param_name].add((int(expert), which))

        loaded = super().load_weights(dense_weights())
        for name, got in seen.items():
            experts = params[name].shape[0]
            if len(got) == experts * (1 if name.endswith("w2_weight") else 2):
                loaded.add(name)
        return loaded

    @classmethod
    def checkpoint_skip(cls, model_config: ModelConfig) -> Optional[Callable[[str], bool]]:
        """With expert parallelism: a predicate naming the checkpoint tensors of other ranks'
        experts, which the loader then never reads (None: every tensor is needed)."""
        ep_rank, ep_size = get_ep_rank(), get_ep_world_size()
        hf = model_config.hf_config
        num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        if ep_size == 1 or num_experts % ep_size:
            return None              # FusedMoE raises the clear error for the latter
        per_rank = num_experts // ep_size
        start, end = ep_rank * per_rank, (ep_rank + 1) * per_rank

        def skip(name: str) -> bool:
            match = _EXPERT_TENSOR.match(name)
            return match is not None and not start <= int(match.group(2)) < end

        return skip


class MixtralForCausalLM(MoEForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
    expert_projections = {"w1": "w1", "w3": "w3", "w2": "w2"}
    renamed_modules = {"block_sparse_moe": "mlp"}

    @staticmethod
    def decoder_flags(hf_config: dict) -> DecoderFlags:
        return DecoderFlags()              # no biases


_QWEN_EXPERT_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class Qwen2MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = QwenMoeDecoderLayer
    expert_projections = _QWEN_EXPERT_PROJECTIONS

    @staticmethod
    def decoder_flags(hf_config: dict) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(hf_config.get("qkv_bias", True)))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = QwenMoeDecoderLayer
    expert_projections = _QWEN_EXPERT_PROJECTIONS
    decoder_flags = staticmethod(Qwen3ForCausalLM.decoder_flags)
