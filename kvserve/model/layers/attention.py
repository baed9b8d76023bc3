"""The Attention layer: q/k/v of one decoder layer in, through the chosen attention backend
(kvserve.attention), attention output out.

The model runner binds its backend to every Attention layer after loading the model
(`bind_attention_backend`); a layer with none bound (a model built by hand, in tests) uses
CPU_ATTN, whose kernels fall back to torch off CPU. AttentionMetadata (CPU_ATTN's and
TORCH_SDPA's per-step metadata) is re-exported here for the callers that build it directly.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from kvserve.attention.backends.base import AttentionBackend
from kvserve.attention.backends.cpu import AttentionMetadata, CpuAttentionBackend

__all__ = ["Attention", "AttentionMetadata", "bind_attention_backend"]


@functools.lru_cache(maxsize=1)
def _default_backend() -> AttentionBackend:
    return CpuAttentionBackend(torch.device("cpu"))


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
        backend = self.backend if self.backend is not None else _default_backend()
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
