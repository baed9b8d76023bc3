"""Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3 in one implementation.

The architectures differ only in a few switches (`DecoderFlags`): which projections carry a
bias, and Qwen3's per-head RMSNorm on q and k before the rotary embedding. Each
`*ForCausalLM` class only says how its config.json sets those switches.

Tokens of all scheduled requests arrive flattened: input_ids / positions are [T], and the
residual stream is [T, hidden]. Attention reads and writes the paged KV cache of its layer.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from kvserve.attention.backends.cpu import AttentionMetadata
from kvserve.config import ModelConfig, layer_sliding_windows
from kvserve.distributed.parallel_state import (get_pp_rank, get_pp_world_size,
                                                is_first_pp_rank, is_last_pp_rank)
from kvserve.distributed.pp_utils import (IntermediateTensors, PPMissingLayer, get_pp_indices,
                                          missing_prefixes)
from kvserve.model.layers.attention import Attention
from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers.fused_decode import FusedDecodeStack
from kvserve.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                         RowParallelLinear, default_weight_loader)
from kvserve.model.layers.norm import RMSNorm
from kvserve.model.layers.rotary import RotaryEmbedding, get_rope
from kvserve.ops.decode_layers import decode_layers_op


@dataclass(frozen=True)
class DecoderFlags:
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False          # Qwen3: RMSNorm over each q/k head before rotary


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward_silu_and_mul(self.gate_up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, flags: DecoderFlags) -> None:
        super().__init__()
        hf = config.hf_config
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads, config.num_kv_heads,
                                          bias=flags.qkv_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=flags.o_proj_bias)
        self.rotary_emb = get_rope(self.head_dim, hf)
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.qkv_proj.num_kv_heads)
        self.qk_norm = flags.qk_norm
        if self.qk_norm:
            eps = float(hf.get("rms_norm_eps", 1e-6))
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            T = q.shape[0]
            q = self.q_norm(q.reshape(T, -1, self.head_dim)).view(T, self.q_size)
            k = self.k_norm(k.reshape(T, -1, self.head_dim)).view(T, self.kv_size)
        # The rotation goes with q and k: TRITON_ATTN fuses it with its KV-cache write.
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata,
                                     rope=(self.rotary_emb, positions)))


def share_rope(layers: list[nn.Module]) -> None:
    """One rotary table for all layers, not one each: every layer's is built from the same
    config, and at 8k positions they cost 2 MB a layer (60 MB for the demo's 30 layers, as
    much as its Q4_1 weights)."""
    ropes = [layer.self_attn.rotary_emb for layer in layers]
    if ropes and all(type(r) is RotaryEmbedding for r in ropes) and all(
            torch.equal(r.cos_cache, ropes[0].cos_cache) and torch.equal(r.sin_cache, ropes[0].sin_cache)
            for r in ropes[1:]):
        for layer in layers[1:]:
            layer.self_attn.rotary_emb = ropes[0]


class LlamaDecoderLayer(nn.Module):
    # Whether ops.decode_layers (fused_decode.py) can run this layer: a dense LlamaMLP only.
    supports_fused_decode = True

    def __init__(self, config: ModelConfig, flags: DecoderFlags, layer_idx: int = 0) -> None:
        super().__init__()
        hf = config.hf_config
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.layer_idx = layer_idx
        self.self_attn = LlamaAttention(config, flags)
        self.mlp = self.build_mlp(config, flags, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: Optional[torch.Tensor], kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is folded into the next norm: (x, residual) -> (norm(x + r), x + r).
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def build_mlp(self, config: ModelConfig, flags: DecoderFlags, layer_idx: int) -> nn.Module:
        """The feed-forward block; mixture-of-experts layers (moe.py) override it."""
        return LlamaMLP(config.hidden_size, int(config.hf_config["intermediate_size"]),
                        flags.mlp_bias)


class LlamaModel(nn.Module):
    """The decoder stack, or this pipeline stage's slice of it: layers [start_layer,
    end_layer); the embedding on the first stage, the final norm on the last. Layers of other
    stages are PPMissingLayer, so parameter names keep their checkpoint indices."""

    def __init__(self, config: ModelConfig, flags: DecoderFlags,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        self.start_layer, self.end_layer = get_pp_indices(config.num_layers, get_pp_rank(),
                                                          get_pp_world_size())
        self.is_first, self.is_last = is_first_pp_rank(), is_last_pp_rank()
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if self.is_first else PPMissingLayer())
        self.layers = nn.ModuleList(
            layer_cls(config, flags, i) if self.start_layer <= i < self.end_layer
            else PPMissingLayer() for i in range(config.num_layers))
        self.norm = (RMSNorm(config.hidden_size, float(config.hf_config.get("rms_norm_eps", 1e-6)))
                     if self.is_last else PPMissingLayer())
        # A plain list: slicing the ModuleList builds a new one per step (~0.2 ms at batch 1).
        self._local_layers = list(self.layers)[self.start_layer:self.end_layer]
        share_rope(self._local_layers)
        # Small decode steps on CPU: all layers in one C++ call (fused_decode.py). Decided on
        # the first such step, when the weights are final and the attention backend is bound.
        self._fused_decode: Optional[FusedDecodeStack] = None
        # Layers the fused op cannot run (MoE) never take it; tests set True for the
        # layer-by-layer path.
        self._fused_decode_decided = not layer_cls.supports_fused_decode
        # Multi-LoRA's per-step mapping (kvserve.lora.punica.LoRAMapping), set when LoRA is on:
        # the fused op adds the adapter deltas itself where it can (FusedDecodeStack.takes_lora).
        self.lora_mapping: Optional[Any] = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                intermediate_tensors: Optional[IntermediateTensors] = None,
                ) -> Union[torch.Tensor, IntermediateTensors]:
        layers = self._local_layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"Got {len(kv_caches)} KV caches for {len(layers)} layers.")
        if self.is_first:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            assert intermediate_tensors is not None, "a later stage needs the previous one's output"
            hidden_states = intermediate_tensors.hidden_states
            residual = intermediate_tensors.residual
        fused = self._fused_decode_for(layers, hidden_states.shape[0], attn_metadata)
        if fused is not None:
            hidden_states, residual = fused(positions, hidden_states, residual, kv_caches,
                                            attn_metadata, self.lora_mapping)
        else:
            for layer, kv_cache in zip(layers, kv_caches):
                hidden_states, residual = layer(positions, hidden_states, residual, kv_cache,
                                                attn_metadata)
        if not self.is_last:
            return IntermediateTensors(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def process_weights_after_loading(self) -> None:
        """Compile the fused small-step op (and the kernels it calls) at load, not in the
        first step: an engine killed during its first request (the kill tests) then cannot
        die mid-build and leave the build's lock for every later engine to wait on."""
        if not self._fused_decode_decided and next(self.parameters()).device.type == "cpu":
            decode_layers_op()

    def _fused_decode_for(self, layers: list[nn.Module], num_tokens: int,
                          attn_metadata: AttentionMetadata) -> Optional[FusedDecodeStack]:
        if not FusedDecodeStack.applies(num_tokens, attn_metadata):
            return None
        if not self._fused_decode_decided:
            self._fused_decode = FusedDecodeStack.build(layers)
            self._fused_decode_decided = True
        fused, mapping = self._fused_decode, self.lora_mapping
        if fused is not None and not fused.takes(num_tokens):
            return None
        if fused is not None and mapping is not None and mapping.groups and (
                mapping.num_tokens != num_tokens or not fused.takes_lora(mapping)):
            return None
        return fused


class LlamaForCausalLM(nn.Module):
    # Checkpoint module -> (fused module here, shard id passed to its weight_loader).
    packed_modules_mapping: dict[str, tuple[str, Union[str, int]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    @staticmethod
    def decoder_flags(hf_config: dict) -> DecoderFlags:
        bias = bool(hf_config.get("attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_proj_bias=bias,
                            mlp_bias=bool(hf_config.get("mlp_bias", False)))

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{type(self).__name__}: hidden_act={act!r} is not supported (silu only).")
        self.config = config
        self.model = LlamaModel(config, self.decoder_flags(hf), self.decoder_layer_cls)
        # Mistral / Qwen2 `sliding_window` (a window >= max_model_len is none): windowed layers
        # take the torch attention path, so never the fused C++ decode op.
        windows = layer_sliding_windows(hf, config.max_model_len)
        if any(windows):
            for layer in self.model._local_layers:
                layer.self_attn.attn.sliding_window = windows[layer.layer_idx]
            self.model._fused_decode, self.model._fused_decode_decided = None, True
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if self.model.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings and self.model.is_first:
                self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self._missing = missing_prefixes(self)

    @property
    def num_local_layers(self) -> int:
        return self.model.end_layer - self.model.start_layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                intermediate_tensors: Optional[IntermediateTensors] = None,
                ) -> Union[torch.Tensor, IntermediateTensors]:
        """input_ids / positions [T] -> final hidden states [T, hidden] (the last pipeline
        stage) or the residual stream for the next stage."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> float32 logits [N, vocab_size]."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; return the names of the parameters fully loaded.

        A tensor that matches no parameter is an error. A fused parameter counts as loaded
        only once all of its shards (q, k, v / gate, up) have been seen.
        """
        params = dict(self.named_parameters())
        seen: dict[str, set] = defaultdict(set)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:      # recomputed, not learned
                continue
            if self.tie_word_embeddings:
                if name == "lm_head.weight":
                    continue                       # same tensor as embed_tokens
                if name == "model.embed_tokens.weight" and self.model.is_last \
                        and not self.model.is_first:
                    name = "lm_head.weight"        # last stage: the LM head loads its own copy
            if name.startswith(self._missing):     # another pipeline stage holds it
                continue
            parts = name.split(".")
            shard_id = None
            if len(parts) >= 2 and parts[-2] in self.packed_modules_mapping:
                parts[-2], shard_id = self.packed_modules_mapping[parts[-2]]
            param_name = ".".join(parts)
            param = params.get(param_name)
            if param is None:
                raise ValueError(f"Checkpoint tensor {name!r} matches no parameter of "
                                 f"{type(self).__name__} (is config.json right for this checkpoint?).")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"Loading checkpoint tensor {name!r}: {e}") from None
            seen[param_name].add(shard_id)
        shards: dict[str, set] = defaultdict(set)
        for fused, shard_id in self.packed_modules_mapping.values():
            shards[fused].add(shard_id)
        return {name for name, got in seen.items()
                if got >= shards.get(name.split(".")[-2], {None})}


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_flags(hf_config: dict) -> DecoderFlags:
        return DecoderFlags()              # Mistral has no biases


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_flags(hf_config: dict) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True)  # q/k/v biased, o_proj and MLP not


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_flags(hf_config: dict) -> DecoderFlags:
        bias = bool(hf_config.get("attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)
