"""Paged attention over a flattened "super-sequence".

One step's tokens from every scheduled request are concatenated into one sequence of T tokens.
Decode requests (one new token each) come first, then prefill chunks:

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      T = 9
              decodes     prefill 0     prefill 1
    slot_mapping[t] = block_id * block_size + offset  (where token t's K/V is written)

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
All decodes of a step are attended in one call (kvserve.ops.paged_decode_attention), and all
prefill chunks in another (kvserve.ops.prefill_attention: each chunk attends to its cached
prefix plus causally to itself). Both read K/V straight from the blocks with a compiled CPU
kernel, or fall back to torch (CUDA, other dtypes, KVSERVE_DISABLE_CPU_KERNELS=1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from kvserve.ops import paged_decode_attention
from kvserve.ops.fused import reshape_and_cache
from kvserve.ops.prefill_attention import paged_prefill_attention


@dataclass
class AttentionMetadata:
    num_decode_tokens: int                 # decodes occupy tokens [0, num_decode_tokens)
    slot_mapping: torch.Tensor             # [T] int64
    block_size: int
    # Decodes: one row per decode request.
    decode_block_tables: Optional[torch.Tensor] = None   # [Nd, max_blocks] int64
    decode_seq_lens: Optional[torch.Tensor] = None       # [Nd] int64, including the new token
    # Prefill chunks, in token order after the decodes; None when the step has none.
    prefill_query_starts: Optional[torch.Tensor] = None   # [P] int64, first token of chunk p
    prefill_query_lens: Optional[torch.Tensor] = None     # [P] int64
    prefill_context_lens: Optional[torch.Tensor] = None   # [P] int64, tokens already cached
    prefill_block_tables: Optional[torch.Tensor] = None   # [P, max_blocks] int64, padded


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V [T, Hkv, D] into the paged cache at slot_mapping (in place)."""
    reshape_and_cache(k, v, kv_cache, slot_mapping)


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
        T = q.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = q.view(T, H, D)
        k = k.view(T, Hkv, D)
        v = v.view(T, Hkv, D)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.prefill_query_starts is not None:
            # Every chunk in one call, K/V read from the cache (the chunk's own were just
            # written); the decode rows come back as zeros and are filled below.
            assert (meta.prefill_query_lens is not None and meta.prefill_context_lens is not None
                    and meta.prefill_block_tables is not None)
            out = paged_prefill_attention(q, kv_cache, meta.prefill_query_starts,
                                          meta.prefill_query_lens, meta.prefill_context_lens,
                                          meta.prefill_block_tables, self.scale)
        else:
            out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
            out[:nd] = paged_decode_attention(q[:nd], kv_cache, meta.decode_block_tables,
                                              meta.decode_seq_lens, self.scale)
        return out.view(T, H * D)
