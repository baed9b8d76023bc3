"""TORCH_SDPA: the portable fallback, plain torch on any device.

Decodes: one gather of every sequence's K/V rows and batched matmuls; prefill chunks: one
F.scaled_dot_product_attention per chunk; the KV write is an index_copy_. Same metadata as
CPU_ATTN. Slow on CUDA (the gathers, and SDPA's per-shape plans), but it runs everywhere.
"""
from __future__ import annotations

from kvserve.attention.backends.cpu import CpuAttentionBackend


class TorchSDPABackend(CpuAttentionBackend):
    name = "TORCH_SDPA"
    op_suffix = "_torch"    # ops.fused.reshape_and_cache_torch, ...
