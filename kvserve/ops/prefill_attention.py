"""Paged prefill attention: all prefill chunks of a step in one call, K/V read from the cache.

    q              [T, H, D]            the step's queries (decode rows first, then the chunks)
    kv_cache       [2, NB, BS, Hkv, D]  K = kv_cache[0], V = kv_cache[1]; every chunk's own new
                                        K/V is already written into it
    query_starts   [P] int64            chunk p's queries: rows query_starts[p] + [0, query_lens[p])
    query_lens     [P] int64
    context_lens   [P] int64            tokens of chunk p cached before this step
    block_tables   [P, MB] int64        padded; row p's first ceil((ctx + qlen) / BS) ids are used
    -> out         [T, H, D]            same dtype as q; rows outside every chunk are zero

Query i of chunk p is at position context_lens[p] + i and attends to key positions
0 .. context_lens[p] + i (its cached context, then causally its own chunk); key position j is
kv_cache[:, block_tables[p, j // BS], j % BS]. Query head h reads kv head h // (H // Hkv).

Two implementations:
- a C++ CPU kernel (csrc/prefill_attention.cpp), compiled on first use: flash-attention tiles
  over the cache blocks (AVX-512 dpbf16 / FMA), every chunk and head in one parallel call;
- a pure-torch path, one F.scaled_dot_product_attention per chunk as Attention._prefill did,
  used on CUDA, for other dtypes, when the C++ build fails, or when
  disable_cpu_kernels. It is also what the kernel is benchmarked against.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from kvserve.ops.build import CpuKernel

_KERNEL = CpuKernel("prefill_attention.cpp", op="paged_prefill_attention",
                    isa_op="paged_prefill_attention_isa", what="paged prefill attention",
                    fallback="per-chunk F.scaled_dot_product_attention")
cpu_kernel, cpu_kernel_isa, _load_cpu_kernel = _KERNEL.get, _KERNEL.isa, _KERNEL.load


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_starts: torch.Tensor,
                            query_lens: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Prefill attention of every chunk over a paged KV cache (see the module docstring)."""
    out = _KERNEL.run_attention(q, kv_cache, query_starts, query_lens, context_lens,
                                block_tables, float(scale))
    return out if out is not None else paged_prefill_attention_torch(
        q, kv_cache, query_starts, query_lens, context_lens, block_tables, scale)


def paged_prefill_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor,
                                  query_starts: torch.Tensor, query_lens: torch.Tensor,
                                  context_lens: torch.Tensor, block_tables: torch.Tensor,
                                  scale: float) -> torch.Tensor:
    """Pure-torch version: per chunk, gather its keys and values from the cache and run
    F.scaled_dot_product_attention (causal, or with a bool mask when it has context)."""
    out = torch.zeros_like(q)
    _, _, bs, hkv, _ = kv_cache.shape
    gqa = q.shape[1] != hkv
    # One host sync for the metadata, not one per chunk.
    meta = zip(query_starts.tolist(), query_lens.tolist(), context_lens.tolist())
    for p, (start, qlen, ctx) in enumerate(meta):
        if qlen == 0:
            continue
        total = ctx + qlen
        blocks = block_tables[p, :(total + bs - 1) // bs]
        keys = kv_cache[0][blocks].flatten(0, 1)[:total]              # [total, Hkv, D]
        values = kv_cache[1][blocks].flatten(0, 1)[:total]
        chunk_q = q[start:start + qlen]
        if ctx == 0:
            mask, causal = None, True
        else:
            pos_q = torch.arange(ctx, total, device=q.device)
            pos_k = torch.arange(total, device=q.device)
            mask, causal = pos_k[None, :] <= pos_q[:, None], False    # [Q, total] bool
        # 4-D [1, H, Q, D] inputs: 3-D ones fall to SDPA's slow math path on CPU (~10x).
        keys, values = keys.to(q.dtype).transpose(0, 1), values.to(q.dtype).transpose(0, 1)
        o = F.scaled_dot_product_attention(
            chunk_q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
            is_causal=causal, scale=scale, enable_gqa=gqa)[0]          # [H, Q, D]
        out[start:start + qlen] = o.transpose(0, 1)
    return out


def stack_block_tables(tables: Sequence[torch.Tensor], pad: int = 0) -> torch.Tensor:
    """Per-chunk block-id lists -> one [P, max_len] int64 table, padded with `pad` (never
    read: only a chunk's first ceil((ctx + qlen) / BS) entries are)."""
    width = max((len(t) for t in tables), default=0)
    device = tables[0].device if len(tables) else None
    out = torch.full((len(tables), width), pad, dtype=torch.int64, device=device)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out
