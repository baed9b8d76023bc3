"""The Attention layer: q/k/v of one decoder layer in, through the chosen attention backend
(kvserve.attention), attention output out.

Whoever runs a model binds a backend to every Attention layer after loading it
(`bind_attention_backend`): the model runner the one the selector chose, a proposer CPU_ATTN
(whose metadata it builds), a test the one it tests. There is no default: an unbound layer is
an error, never a silent CPU_ATTN on another device.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from kvserve.attention.backends.base import AttentionBackend

__all__ = ["Attention", "bind_attention_backend"]


class Attention(nn.Module):
    """Multi-head / grouped-query attention reading and writing a paged KV cache."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int,
                 scale: Optional[float] = None) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_groups = num_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.backend: Optional[AttentionBackend] = None
        # Set by kv_transfer.worker.bind_kv_connector when a KV connector is configured.
        self.kv_connector: Optional[Any] = None
        self.layer_name = ""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        T = q.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        backend = self.backend
        if backend is None:
            raise RuntimeError("Attention layer has no backend: bind one after loading the model "
                               "(kvserve.model.layers.attention.bind_attention_backend).")
        connector = self.kv_connector
        if connector is not None:   # vLLM's per-layer connector hooks, around the attention
            connector.wait_for_layer_load(self.layer_name)
        out = backend.forward(self, q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D),
                              kv_cache, meta)
        if connector is not None:
            connector.save_kv_layer(self.layer_name, kv_cache)
        return out.view(T, H * D)


def bind_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Every Attention layer of `model` runs through `backend` from now on."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
