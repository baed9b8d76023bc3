"""Phi-3 (`Phi3ForCausalLM`): the Llama decoder with fused checkpoint matrices and LongRoPE.

Its checkpoints store q|k|v as one `qkv_proj` and gate|up as one `gate_up_proj`; loading splits
them into the q/k/v and gate/up shards llama.py's fused layers already take (so tensor
parallelism slices each part as for Llama). Its rope scaling, LongRoPE (`longrope`, formerly
`su`), divides each frequency by a per-dimension factor and scales cos/sin by an attention
factor; transformers switches from the short to the long factors once a sequence passes
`original_max_position_embeddings`, re-rotating what came before -- a switch a paged KV cache
cannot replay, so kvserve runs LongRoPE checkpoints up to that length (exactly) and says so
for a longer max_model_len.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Iterator

import torch

from kvserve.config import ModelConfig
from kvserve.model.layers.rotary import RotaryEmbedding, rope_config
from kvserve.model.llama import DecoderFlags, LlamaForCausalLM


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE with the short factors: inv_freq / short_factor, cos and sin * attention_factor."""

    def __init__(self, head_size: int, max_position: int, base: float,
                 short_factor: list[float], attention_factor: float) -> None:
        super().__init__(head_size, max_position, base)
        if len(short_factor) != head_size // 2:
            raise ValueError(f"longrope short_factor has {len(short_factor)} entries; the head "
                             f"size {head_size} needs {head_size // 2}.")
        # transformers' arithmetic: 1 / (factor * base ** (int64 arange -> float32 / dim)).
        exponent = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        inv_freq = 1.0 / (torch.tensor(short_factor, dtype=torch.float32) * base ** exponent)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.cos_cache = freqs.cos() * attention_factor
        self.sin_cache = freqs.sin() * attention_factor


def phi3_rope(config: ModelConfig) -> RotaryEmbedding | None:
    """The LongRoPE embedding a Phi-3 config asks for (None: plain rope, llama.py's)."""
    hf = config.hf_config
    theta, scaling = rope_config(hf)
    if scaling is None:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type not in ("longrope", "su"):
        return None                  # get_rope takes it (or names what it does not support)
    original = int(scaling.get("original_max_position_embeddings")
                   or hf.get("original_max_position_embeddings")
                   or hf["max_position_embeddings"])
    if config.max_model_len > original:
        raise ValueError(
            f"Phi3ForCausalLM with LongRoPE: max_model_len {config.max_model_len} exceeds "
            f"original_max_position_embeddings {original}, past which transformers switches "
            f"to the long factors and re-rotates the whole sequence; kvserve does not. Set "
            f"max_model_len <= {original}.")
    factor = scaling.get("factor") or hf["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    return LongRopeRotaryEmbedding(config.head_dim, original, theta,
                                   list(scaling["short_factor"]), float(attention_factor))


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_flags(hf_config: dict) -> DecoderFlags:
        return DecoderFlags()              # no biases

    def __init__(self, config: ModelConfig) -> None:
        hf = config.hf_config
        if float(hf.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError("Phi3ForCausalLM: partial_rotary_factor != 1 is not supported.")
        rope = phi3_rope(config)
        if rope is not None:
            # llama.py's get_rope does not know LongRoPE: build with it switched off, then swap.
            plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
            plain["rope_theta"] = rope_config(hf)[0]
            super().__init__(dataclasses.replace(config, hf_config=plain))
            self.config = config
            for layer in self.model._local_layers:
                layer.self_attn.rotary_emb = rope
        else:
            super().__init__(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Split qkv_proj into q/k/v_proj and gate_up_proj into gate/up_proj, then load as Llama."""
        cfg = self.config
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim

        def split(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in stream:
                if name.endswith(".qkv_proj.weight"):
                    if tensor.shape[0] != q + 2 * kv:
                        raise ValueError(f"Checkpoint tensor {name!r} has {tensor.shape[0]} rows; "
                                         f"the config implies {q + 2 * kv} (q {q} + k, v {kv}).")
                    for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv])):
                        yield name.replace(".qkv_proj.", f".{part}."), t
                elif name.endswith(".gate_up_proj.weight"):
                    gate, up = tensor.chunk(2, dim=0)
                    yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                    yield name.replace(".gate_up_proj.", ".up_proj."), up
                else:
                    yield name, tensor

        return super().load_weights(split(weights))
