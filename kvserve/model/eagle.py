"""EAGLE-1 head for Llama targets (vLLM's EagleLlamaForCausalLM): one decoder layer over the
target's hidden states; the proposer that runs it is kvserve/spec_decode/eagle.py.

At position p:

    x   = fc(cat(embed(token[p + 1]), h[p]))     h[p]: the target's final (normed) hidden
    out = decoder_layer(x) + residual            state at p; no input_layernorm on layer 0
                                                 and no final norm (EAGLE's cnets, as vLLM)
    draft for position p + 2 = argmax(lm_head(out))

`embed` and `lm_head` are the target's unless the checkpoint has its own. Checkpoint layout
(vLLM's for EAGLE-Llama, e.g. yuhuili/EAGLE-LLaMA3-Instruct-8B): config.json (a Llama config,
usually num_hidden_layers 1) and tensors `fc.weight` [hidden, 2 * hidden] (+ `fc.bias`),
`layers.0.*`, optionally `embed_tokens.weight` / `lm_head.weight`, with or without a
`model.` prefix; `layers.0.input_layernorm.weight` may be present and is unused (as in EAGLE).
"""
from __future__ import annotations

import os
from typing import Iterator

import torch
from torch import nn

from kvserve.attention.backends.cpu import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.model.layers.linear import default_weight_loader
from kvserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvserve.model.loader import build_and_load, safetensors_files

# Checkpoint tensors EAGLE-1 never uses (vLLM skips them too).
_UNUSED = ("layers.0.input_layernorm.weight", "norm.weight")


def eagle_weight_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor name (no `model.` prefix) -> shape, read from the checkpoint headers only."""
    shapes = {}
    for name, get_shape in _checkpoint_tensors(path, shapes_only=True):
        shapes[_strip(name)] = tuple(get_shape)
    return shapes


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _checkpoint_tensors(path: str, shapes_only: bool = False) -> Iterator[tuple[str, object]]:
    """(name, tensor) from model*.safetensors, or pytorch_model.bin (EAGLE's own releases);
    with shapes_only, (name, shape) without reading the data."""
    bin_file = os.path.join(path, "pytorch_model.bin")
    try:
        files = safetensors_files(path)
    except FileNotFoundError:
        if not os.path.isfile(bin_file):
            raise
        state = torch.load(bin_file, map_location="cpu", weights_only=True, mmap=True)
        for name, t in state.items():
            yield name, (t.shape if shapes_only else t)
        return
    from safetensors import safe_open
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (f.get_slice(name).get_shape() if shapes_only else f.get_tensor(name))


class EagleHead(nn.Module):
    """fc + the decoder layer(s); embed_tokens / lm_head only when the checkpoint has them."""

    def __init__(self, config: ModelConfig, fc_bias: bool, own_embed: bool,
                 own_lm_head: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        flags = LlamaForCausalLM.decoder_flags(config.hf_config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, flags)
                                    for _ in range(config.num_layers))
        # EAGLE feeds fc's output to layer 0 without a norm.
        self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h) if own_embed else None
        self.lm_head = ParallelLMHead(config.vocab_size, h) if own_lm_head else None

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, hidden.to(embeds.dtype)], dim=-1))
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return x + residual

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        packed = LlamaForCausalLM.packed_modules_mapping
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = _strip(raw)
            if name in _UNUSED or "rotary_emb.inv_freq" in name:
                continue
            parts = name.split(".")
            shard_id = None
            if len(parts) >= 2 and parts[-2] in packed:
                parts[-2], shard_id = packed[parts[-2]]
            param = params.get(".".join(parts))
            if param is None:
                raise ValueError(f"EAGLE checkpoint tensor {raw!r} matches nothing of an "
                                 "EAGLE-Llama head (fc, layers.N.*, embed_tokens, lm_head).")
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(".".join(parts))
        return loaded


def load_eagle_head(model_config: ModelConfig, device: torch.device) -> EagleHead:
    """The head of the checkpoint at model_config.model, its weights loaded onto `device`."""
    shapes = eagle_weight_shapes(model_config.model)
    head = build_and_load(
        lambda: EagleHead(model_config, "fc.bias" in shapes, "embed_tokens.weight" in shapes,
                          "lm_head.weight" in shapes),
        _checkpoint_tensors(model_config.model), model_config, device)
    assert isinstance(head, EagleHead)
    return head
