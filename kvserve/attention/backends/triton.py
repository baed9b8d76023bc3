"""TRITON_ATTN: Triton kernels over the paged cache (kvserve/attention/ops), default on CUDA.

Per step: the KV write kernel, then either the split-KV decode kernel (every request decodes
one token: the all-decode steps CUDA graphs capture) or the unified kernel (prefill chunks with
context plus decode rows, in one launch). The metadata is a handful of int32 arrays; on CUDA
they are packed into one pinned host buffer and copied to the device in one transfer.
On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1): tests only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from kvserve.attention.backends.base import (AttentionBackend, AttentionLayer,
                                             CommonAttentionMetadata)


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int32, < 0 = do not write (padding rows)
    query_start_loc: torch.Tensor   # [R + 1] int32
    seq_lens: torch.Tensor          # [R] int32, 0 = padding request (CUDA graphs)
    block_table: torch.Tensor       # [R, MB] int32
    num_reqs: int
    decode_only: bool               # every request has one query: the split-KV kernel
    # A mixed CUDA-graph bucket: tokens past the step's belong to no request, so the unified
    # kernel never writes their rows; their output is zeroed first (cuda_graph.py).
    padded: bool = False


class TritonAttentionBackend(AttentionBackend):
    name = "TRITON_ATTN"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # Importing the kernels defines them: compiled on a GPU, interpreted on CPU.
        from kvserve.attention.ops import decode_attention, reshape_and_cache, unified_attention
        self._ops = (reshape_and_cache.reshape_and_cache, unified_attention.unified_attention,
                     decode_attention.split_kv_decode_attention,
                     decode_attention.choose_num_splits)
        # Pinned staging, two buffers used in turn (CUDA): with async scheduling step N+1's
        # metadata is staged before step N has run, while N's copy may still be pending.
        self._staging: list[Optional[torch.Tensor]] = [None, None]
        self._next_staging = 0
        # Split-KV programs to aim for: a few per streaming multiprocessor on a GPU; few under
        # the CPU interpreter, where every program costs milliseconds.
        self.target_programs = (
            4 * torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 8)

    def _upload(self, host: np.ndarray) -> torch.Tensor:
        """One host-to-device copy of the packed metadata (pinned staging on CUDA). The copy
        from the buffer used two steps ago has finished: that step's sampled tokens were read
        back since (one step ahead at most with async scheduling)."""
        buf = torch.from_numpy(host)
        if self.device.type != "cuda":
            return buf
        i = self._next_staging
        self._next_staging ^= 1
        staging = self._staging[i]
        if staging is None or staging.numel() < buf.numel():
            staging = self._staging[i] = torch.empty(max(buf.numel(), 1 << 16),
                                                     dtype=torch.int32, pin_memory=True)
        staged = staging[:buf.numel()]
        staged.copy_(buf)
        return staged.to(self.device, non_blocking=True)

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        R, T, bs = common.num_reqs, common.num_tokens, common.block_size
        seq_lens = common.seq_lens
        width = max(1, -(-int(seq_lens.max()) // bs)) if R else 1
        sizes = (T, R + 1, R, R * width)
        host = np.empty(sum(sizes), dtype=np.int32)
        o = np.cumsum((0,) + sizes)
        host[o[0]:o[1]] = common.slot_mapping
        host[o[1]] = 0
        np.cumsum(common.query_lens, out=host[o[1] + 1:o[2]])
        host[o[2]:o[3]] = seq_lens
        host[o[3]:o[4]].reshape(R, width)[:] = common.block_table[:, :width]
        dev = self._upload(host)
        return TritonAttentionMetadata(
            slot_mapping=dev[o[0]:o[1]], query_start_loc=dev[o[1]:o[2]],
            seq_lens=dev[o[2]:o[3]], block_table=dev[o[3]:o[4]].view(R, width),
            num_reqs=R, decode_only=common.num_decodes == R)

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, meta: TritonAttentionMetadata) -> torch.Tensor:
        self._ops[0](k, v, kv_cache, meta.slot_mapping)
        return self._attend(layer, q, kv_cache, meta)

    def forward_with_rotary(self, layer: AttentionLayer, rotary: Any, positions: torch.Tensor,
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            kv_cache: torch.Tensor, meta: TritonAttentionMetadata) -> torch.Tensor:
        """forward() of un-rotated q and k: one kernel rotates them and writes k and v into
        the cache (kvserve/ops/triton/fused.py), then attention as forward()."""
        from kvserve.ops.triton.fused import rotary_embedding_and_cache
        rotary_embedding_and_cache(positions, q, k, v, layer.head_dim, rotary.cos_cache,
                                   rotary.sin_cache, kv_cache, meta.slot_mapping)
        return self._attend(layer, q, kv_cache, meta)

    def _attend(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: TritonAttentionMetadata) -> torch.Tensor:
        _, unified, split_kv, num_splits = self._ops
        window = getattr(layer, "sliding_window", None)
        softcap = getattr(layer, "logits_soft_cap", None)
        if window or softcap:   # the kernels take neither yet: the torch path
            return _forward_windowed(layer, q, kv_cache, meta, window, softcap)
        if meta.decode_only:
            return split_kv(q, kv_cache, meta.seq_lens, meta.block_table, layer.scale,
                            num_splits(meta.num_reqs, layer.num_kv_heads, self.target_programs))
        return unified(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                       layer.scale, out=torch.zeros_like(q) if meta.padded else None)


def _forward_windowed(layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                      meta: TritonAttentionMetadata, window: Optional[int],
                      softcap: Optional[float]) -> torch.Tensor:
    """Sliding-window / soft-capped layers through kvserve.attention.windowed: all-decode
    steps batched, otherwise every request as a chunk."""
    from kvserve.attention.windowed import windowed_decode_attention, windowed_prefill_attention
    R = meta.num_reqs
    if meta.decode_only:
        return windowed_decode_attention(q[:R], kv_cache, meta.block_table, meta.seq_lens,
                                         layer.scale, window, softcap)
    starts = meta.query_start_loc[:-1].long()
    lens = meta.query_start_loc[1:].long() - starts
    return windowed_prefill_attention(q, kv_cache, starts, lens, meta.seq_lens.long() - lens,
                                      meta.block_table, layer.scale, window, softcap)
