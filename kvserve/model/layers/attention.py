"""Paged attention over a flattened "super-sequence".

One step's tokens from every scheduled request are concatenated into one sequence of T tokens.
Decode requests (one new token each) come first, then prefill chunks:

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]      T = 9
              decodes     prefill 0     prefill 1
    slot_mapping[t] = block_id * block_size + offset  (where token t's K/V is written)

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim].
All decodes of a step are attended in one call (kvserve.ops.paged_decode_attention: a
compiled CPU kernel reading K/V straight from the blocks, or a torch fallback); each prefill chunk attends to its
cached prefix (context) plus causally to itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.ops import paged_decode_attention
from kvserve.ops.fused import reshape_and_cache


@dataclass
class AttentionMetadata:
    num_decode_tokens: int                 # decodes occupy tokens [0, num_decode_tokens)
    slot_mapping: torch.Tensor             # [T] int64
    block_size: int
    # Decodes: one row per decode request.
    decode_block_tables: Optional[torch.Tensor] = None   # [Nd, max_blocks] int64
    decode_seq_lens: Optional[torch.Tensor] = None       # [Nd] int64, including the new token
    # Prefill chunks, in token order after the decodes.
    prefill_query_starts: list[int] = field(default_factory=list)
    prefill_query_lens: list[int] = field(default_factory=list)
    prefill_context_lens: list[int] = field(default_factory=list)   # tokens already cached
    prefill_block_tables: list[torch.Tensor] = field(default_factory=list)  # [n_blocks] each


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
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
            out[:nd] = paged_decode_attention(q[:nd], kv_cache, meta.decode_block_tables,
                                              meta.decode_seq_lens, self.scale)
        for start, qlen, ctx, blocks in zip(meta.prefill_query_starts, meta.prefill_query_lens,
                                            meta.prefill_context_lens, meta.prefill_block_tables):
            out[start:start + qlen] = self._prefill(
                q[start:start + qlen], k[start:start + qlen], v[start:start + qlen],
                ctx, blocks, kv_cache, meta.block_size)
        return out.view(T, H * D)

    # ------------------------------------------------------------------
    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int,
                 blocks: torch.Tensor, kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """One prefill chunk: q [Q, H, D] attends to `ctx` cached tokens + causally to itself."""
        qlen = q.shape[0]
        if ctx == 0:
            keys, values, mask, causal = k, v, None, True
        else:
            total = ctx + qlen
            keys = kv_cache[0][blocks].flatten(0, 1)[:total]       # [total, Hkv, D]
            values = kv_cache[1][blocks].flatten(0, 1)[:total]
            pos_q = torch.arange(ctx, total, device=q.device)
            pos_k = torch.arange(total, device=q.device)
            mask = pos_k[None, :] <= pos_q[:, None]                # [Q, total] bool
            causal = False
        # 4-D [1, H, Q, D] inputs: 3-D ones fall to SDPA's slow math path on CPU (~10x).
        keys, values = keys.to(q.dtype).transpose(0, 1), values.to(q.dtype).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
            is_causal=causal, scale=self.scale, enable_gqa=self.num_groups > 1)[0]  # [H, Q, D]
        return out.transpose(0, 1)
