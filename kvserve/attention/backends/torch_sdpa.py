"""TORCH_SDPA: the portable fallback, plain torch on any device.

Decodes: one gather of every sequence's K/V rows and batched matmuls; prefill chunks: one
F.scaled_dot_product_attention per chunk; the KV write is an index_copy_. Same metadata as
CPU_ATTN. Slow on CUDA (the gathers, and SDPA's per-shape plans), but it runs everywhere.
"""
from __future__ import annotations

import torch

from kvserve.attention.backends.cpu import CpuAttentionBackend


class TorchSDPABackend(CpuAttentionBackend):
    name = "TORCH_SDPA"

    @staticmethod
    def _write_kv(k, v, kv_cache, slot_mapping) -> None:
        from kvserve.ops.fused import reshape_and_cache_torch
        reshape_and_cache_torch(k, v, kv_cache, slot_mapping)

    @staticmethod
    def _decode(q, kv_cache, block_tables, seq_lens, scale) -> torch.Tensor:
        from kvserve.ops.paged_attention import paged_decode_attention_torch
        return paged_decode_attention_torch(q, kv_cache, block_tables, seq_lens, scale)

    @staticmethod
    def _prefill(q, kv_cache, starts, lens, ctxs, tables, scale) -> torch.Tensor:
        from kvserve.ops.prefill_attention import paged_prefill_attention_torch
        return paged_prefill_attention_torch(q, kv_cache, starts, lens, ctxs, tables, scale)
