"""CPU_ATTN: kvserve's C++ CPU kernels (kvserve/ops), the default on CPU.

All decodes of a step are attended in one call (ops.paged_decode_attention) and all prefill
chunks in another (ops.paged_prefill_attention: each chunk attends to its cached prefix plus
causally to itself); both read K/V straight from the blocks. Where a kernel cannot run (other
dtypes, a failed build, KVSERVE_DISABLE_CPU_KERNELS=1) those functions fall back to torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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

    # The three ops, overridden by TORCH_SDPA with the pure-torch versions.
    @staticmethod
    def _write_kv(k, v, kv_cache, slot_mapping) -> None:
        from kvserve.ops.fused import reshape_and_cache
        reshape_and_cache(k, v, kv_cache, slot_mapping)

    @staticmethod
    def _decode(q, kv_cache, block_tables, seq_lens, scale) -> torch.Tensor:
        from kvserve.ops.paged_attention import paged_decode_attention
        return paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale)

    @staticmethod
    def _prefill(q, kv_cache, starts, lens, ctxs, tables, scale) -> torch.Tensor:
        from kvserve.ops.prefill_attention import paged_prefill_attention
        return paged_prefill_attention(q, kv_cache, starts, lens, ctxs, tables, scale)

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self._write_kv(k, v, kv_cache, meta.slot_mapping)
        if meta.prefill_query_starts is not None:
            # Every chunk in one call, K/V read from the cache (the chunk's own were just
            # written); the decode rows come back as zeros and are filled below.
            assert (meta.prefill_query_lens is not None and meta.prefill_context_lens is not None
                    and meta.prefill_block_tables is not None)
            out = self._prefill(q, kv_cache, meta.prefill_query_starts, meta.prefill_query_lens,
                                meta.prefill_context_lens, meta.prefill_block_tables,
                                layer.scale)
        else:
            out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
            out[:nd] = self._decode(q[:nd], kv_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, layer.scale)
        return out
