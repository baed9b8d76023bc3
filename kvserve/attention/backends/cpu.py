"""CPU_ATTN: kvserve's C++ CPU kernels (kvserve/ops), the default on CPU.

All decodes of a step are attended in one call (ops.paged_decode_attention) and all prefill
chunks in another (ops.paged_prefill_attention: each chunk attends to its cached prefix plus
causally to itself); both read K/V straight from the blocks. Where a kernel cannot run (other
dtypes, a failed build, KVSERVE_DISABLE_CPU_KERNELS=1) those functions fall back to torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvserve.attention.backends.base import (AttentionBackend, AttentionLayer,
                                             CommonAttentionMetadata)


@dataclass
class AttentionMetadata:
    """The C++ kernels' (and TORCH_SDPA's) metadata: decodes and prefill chunks apart."""
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


@functools.cache
def _ops(suffix: str) -> tuple[Callable[..., Any], ...]:
    """kvserve.ops' KV write, prefill and decode attention (`suffix` "_torch": their pure-torch
    twins), imported on first use."""
    from kvserve.ops import fused, paged_attention, prefill_attention
    return (getattr(fused, "reshape_and_cache" + suffix),
            getattr(prefill_attention, "paged_prefill_attention" + suffix),
            getattr(paged_attention, "paged_decode_attention" + suffix))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_split_metadata(common: CommonAttentionMetadata, device: torch.device) -> AttentionMetadata:
    bs, nd = common.block_size, common.num_decodes

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    seq_lens = common.seq_lens
    meta = AttentionMetadata(num_decode_tokens=nd, slot_mapping=dev(common.slot_mapping),
                             block_size=bs)
    if nd:
        width = _cdiv(int(seq_lens[:nd].max()), bs)
        meta.decode_block_tables = dev(common.block_table[:nd, :width])
        meta.decode_seq_lens = dev(seq_lens[:nd])
    if nd < common.num_reqs:
        p = slice(nd, None)
        meta.prefill_query_starts = dev(common.query_starts[p])
        meta.prefill_query_lens = dev(common.query_lens[p])
        meta.prefill_context_lens = dev(common.context_lens[p])
        width = _cdiv(int(seq_lens[p].max()), bs)
        meta.prefill_block_tables = dev(common.block_table[p, :width])
    return meta


class CpuAttentionBackend(AttentionBackend):
    name = "CPU_ATTN"

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return build_split_metadata(common, self.device)

    op_suffix = ""    # of the three ops (_ops): TORCH_SDPA takes their pure-torch twins

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        write_kv, prefill, decode = _ops(self.op_suffix)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        window = getattr(layer, "sliding_window", None)
        softcap = getattr(layer, "logits_soft_cap", None)
        if window or softcap:   # the C++ kernels take neither: the torch path
            return _forward_windowed(layer, q, kv_cache, meta, window, softcap)
        if meta.prefill_query_starts is not None:
            # Every chunk in one call, K/V read from the cache (the chunk's own were just
            # written); the decode rows come back as zeros and are filled below.
            assert (meta.prefill_query_lens is not None and meta.prefill_context_lens is not None
                    and meta.prefill_block_tables is not None)
            out = prefill(q, kv_cache, meta.prefill_query_starts, meta.prefill_query_lens,
                          meta.prefill_context_lens, meta.prefill_block_tables, layer.scale)
        else:
            out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
            out[:nd] = decode(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_seq_lens,
                              layer.scale)
        return out


def _forward_windowed(layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, window: Optional[int],
                      softcap: Optional[float]) -> torch.Tensor:
    """Sliding-window / soft-capped attention (kvserve.attention.windowed), K/V written."""
    from kvserve.attention.windowed import windowed_decode_attention, windowed_prefill_attention
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if meta.prefill_query_starts is not None:
        assert (meta.prefill_query_lens is not None and meta.prefill_context_lens is not None
                and meta.prefill_block_tables is not None)
        windowed_prefill_attention(q, kv_cache, meta.prefill_query_starts,
                                   meta.prefill_query_lens, meta.prefill_context_lens,
                                   meta.prefill_block_tables, layer.scale, window, softcap, out)
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        out[:nd] = windowed_decode_attention(q[:nd], kv_cache, meta.decode_block_tables,
                                             meta.decode_seq_lens, layer.scale, window, softcap)
    return out
