"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3 text (`Gemma3ForCausalLM`).

Llama's linear layers, embedding and LM head, with Gemma's differences:
  - RMSNorm scales by (1 + weight), in float32; four norms per layer (input, post-attention,
    pre- and post-feed-forward), each sub-block's output normed before the residual add;
  - the embedding is multiplied by sqrt(hidden_size); the MLP is GELU (tanh) gated;
  - attention scale query_pre_attn_scalar ** -0.5; Gemma 3 RMS-norms q and k per head;
  - interleaved local (sliding window) and global layers (`layer_types`, or Gemma 3's
    `sliding_window_pattern` / Gemma 2's alternation); Gemma 3's local layers rotate with
    `rope_local_base_freq` (transformers >= 5: rope_parameters["sliding_attention"]), its
    global ones with rope_theta and the rope scaling;
  - logit softcapping where the config has it: attention scores (Gemma 2's 50) and final
    logits (Gemma 2's 30): cap * tanh(x / cap).
Windowed and soft-capped layers run kvserve.attention.windowed in every backend; the KV cache
of a model with windows shorter than max_model_len is the hybrid one (kv_cache_coordinator).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.config import ModelConfig, layer_sliding_windows
from kvserve.distributed.parallel_state import get_pp_world_size
from kvserve.distributed.pp_utils import IntermediateTensors
from kvserve.model.layers.attention import Attention
from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                         RowParallelLinear)
from kvserve.model.layers.rotary import RotaryEmbedding, rope_config
from kvserve.model.llama import LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back (transformers' GemmaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


def _rotary(head_dim: int, max_position: int, theta: float,
            scaling: Optional[dict]) -> RotaryEmbedding:
    """Plain rope, or Gemma 3's linear scaling (every frequency / factor)."""
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return RotaryEmbedding(head_dim, max_position, theta)
    if rope_type != "linear":
        raise ValueError(f"Gemma: rope scaling {rope_type!r} is not supported (default, linear).")
    rope = RotaryEmbedding(head_dim, max_position, theta)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent) / float(scaling["factor"])   # type: ignore[index]
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    rope.cos_cache, rope.sin_cache = freqs.cos(), freqs.sin()
    return rope


def gemma_ropes(hf: dict, head_dim: int) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """(local, global) rotary embeddings. Gemma 2: one rope for both."""
    max_position = int(hf.get("max_position_embeddings") or 8192)
    params = hf.get("rope_parameters") or {}
    if "sliding_attention" in params:          # transformers >= 5: one entry per layer type
        local, glob = params["sliding_attention"], params["full_attention"]
        return (_rotary(head_dim, max_position, float(local["rope_theta"]), local),
                _rotary(head_dim, max_position, float(glob["rope_theta"]), glob))
    theta, scaling = rope_config(hf)
    glob_rope = _rotary(head_dim, max_position, theta, scaling)
    local_theta = hf.get("rope_local_base_freq")
    if local_theta is None:
        return glob_rope, glob_rope
    return _rotary(head_dim, max_position, float(local_theta), None), glob_rope


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: Optional[int],
                 qk_norm: bool) -> None:
        super().__init__()
        hf = config.hf_config
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          config.num_attention_heads, config.num_kv_heads,
                                          bias=bool(hf.get("attention_bias", False)))
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size,
                                        bias=bool(hf.get("attention_bias", False)))
        self.rotary_emb = rope
        scalar = hf.get("query_pre_attn_scalar") or self.head_dim
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.qkv_proj.num_kv_heads,
                              scale=float(scalar) ** -0.5, sliding_window=window,
                              logits_soft_cap=hf.get("attn_logit_softcapping") or None)
        self.qk_norm = qk_norm
        if qk_norm:
            eps = float(hf.get("rms_norm_eps", 1e-6))
            self.q_norm = GemmaRMSNorm(self.head_dim, eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: object) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            T = q.shape[0]
            q = self.q_norm(q.reshape(T, -1, self.head_dim)).reshape(T, self.q_size)
            k = self.k_norm(k.reshape(T, -1, self.head_dim)).reshape(T, self.kv_size)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        return self.o_proj(self.attn(q, k, v.contiguous(), kv_cache, meta))


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            raise ValueError(f"Gemma: hidden_activation {act!r} is not supported.")
        # transformers maps both "gelu_pytorch_tanh" and Gemma's legacy "gelu" to tanh GELU.
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, window: Optional[int],
                 qk_norm: bool) -> None:
        super().__init__()
        hf = config.hf_config
        eps = float(hf.get("rms_norm_eps", 1e-6))
        h = config.hidden_size
        self.self_attn = GemmaAttention(config, rope, window, qk_norm)
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        self.mlp = GemmaMLP(h, int(hf["intermediate_size"]), act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: object) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool) -> None:
        super().__init__()
        hf = config.hf_config
        n = config.num_layers
        self.start_layer, self.end_layer = 0, n
        self.is_first = self.is_last = True
        # Which layers are local (their rope) vs. which are windowed here (a window no
        # shorter than max_model_len cuts nothing: plain attention, same result).
        local = [w is not None for w in layer_sliding_windows(hf, 1 << 62)]
        windows = layer_sliding_windows(hf, config.max_model_len)
        local_rope, global_rope = gemma_ropes(hf, config.head_dim)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, local_rope if local[i] else global_rope, windows[i],
                              qk_norm) for i in range(n))
        self.norm = GemmaRMSNorm(config.hidden_size, float(hf.get("rms_norm_eps", 1e-6)))
        self.normalizer = config.hidden_size ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: object) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"Got {len(kv_caches)} KV caches for {len(self.layers)} layers.")
        x = self.embed_tokens(input_ids)
        # transformers multiplies by the normalizer in the activation dtype.
        x = x * torch.tensor(self.normalizer, dtype=x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, attn_metadata)
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Reuses LlamaForCausalLM's weight loading (q/k/v and gate/up packed the same way)."""
    qk_norm = False

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        if get_pp_world_size() > 1:
            raise ValueError(f"{type(self).__name__}: pipeline parallelism is not supported.")
        hf = config.hf_config
        self.config = config
        self.model = GemmaModel(config, self.qk_norm)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.final_logit_softcapping = hf.get("final_logit_softcapping") or None
        self._missing = ()

    @property
    def num_local_layers(self) -> int:
        return len(self.model.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: object,
                intermediate_tensors: Optional[IntermediateTensors] = None,
                ) -> Union[torch.Tensor, IntermediateTensors]:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
