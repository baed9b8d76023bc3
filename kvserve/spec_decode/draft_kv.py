"""Paged KV for a proposer's own layers (draft model, EAGLE head): its KV tensors are indexed
by the target's block ids (as many blocks as the target's cache), so a batch of proposer
queries is addressed with the target's block table and slot mapping. Helpers: the KV tensors'
size and allocation, and the batch (rows reordered with single-token queries (decodes)
first, as the attention kernels expect, and the AttentionMetadata).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.backends.cpu import AttentionMetadata, CpuAttentionBackend
from kvserve.config import KVServeConfig, ModelConfig
from kvserve.model.huge_pages import zeroed_kv_caches
from kvserve.model.layers.attention import bind_attention_backend
from kvserve.model.loader import get_kv_cache_shape


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def proposer_model_config(config: KVServeConfig) -> ModelConfig:
    """The proposer checkpoint's ModelConfig, in the target's dtype and max_model_len."""
    spec, target = config.speculative_config, config.model_config
    assert spec is not None and spec.model is not None
    return ModelConfig.from_path(
        spec.model, tokenizer=None, served_model_name=None, dtype=target.dtype,
        max_model_len=target.max_model_len, seed=target.seed,
        max_logprobs=target.max_logprobs, device=config.device_config.device)


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int, tp_size: int) -> int:
    shape = get_kv_cache_shape(model_config, 1, block_size, tp_size)
    elem = torch.empty((), dtype=model_config.dtype).element_size()
    return int(np.prod(shape)) * elem * model_config.num_layers


def allocate_kv_caches(model_config: ModelConfig, num_blocks: int, block_size: int,
                       tp_size: int, device: torch.device) -> list[torch.Tensor]:
    """One zeroed KV tensor per layer (model/huge_pages.zeroed_kv_caches)."""
    shape = get_kv_cache_shape(model_config, num_blocks, block_size, tp_size)
    return zeroed_kv_caches(shape, model_config.dtype, device, model_config.num_layers)


class OwnKVProposer:
    """A proposer with its own layers' paged KV (draft model, EAGLE head): the proposer
    checkpoint's config, its KV bytes per target block, and its KV tensors."""

    def __init__(self, config: KVServeConfig, device: torch.device) -> None:
        self.device = device
        self.block_size = config.cache_config.block_size
        self.tp_size = config.parallel_config.tensor_parallel_size
        self.model_config = proposer_model_config(config)
        self.kv_caches: list[torch.Tensor] = []

    def bind_attention(self, model: torch.nn.Module) -> None:
        """The proposer's layers run CPU_ATTN (its kernels fall back to torch off CPU): the
        metadata make_draft_batch builds is CPU_ATTN's."""
        bind_attention_backend(model, CpuAttentionBackend(self.device))

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.model_config, self.block_size, self.tp_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model_config, num_blocks, self.block_size,
                                            self.tp_size, self.device)


@dataclass
class DraftBatch:
    """A proposer forward over `rows` (queries flattened in row order), reordered decodes
    first: feed `input_ids[token_order]`, `positions[token_order]`; output token j of the
    forward is input token token_order[j]; `last` indexes each reordered row's last token
    and `order` maps reordered rows back (row_out[order] = row_in)."""
    order: np.ndarray
    token_order: np.ndarray
    positions: np.ndarray          # reordered
    last: np.ndarray               # reordered rows' last-token index in the forward
    metadata: AttentionMetadata


def make_draft_batch(block_table: np.ndarray, rows: np.ndarray, computed: np.ndarray,
                     qlens: np.ndarray, positions: np.ndarray, block_size: int,
                     device: torch.device) -> DraftBatch:
    """rows: input-batch rows; computed: KV positions already valid per row; qlens: query
    tokens per row (>= 1); positions: the flattened query positions in row order."""
    order = np.argsort(qlens != 1, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    token_order = np.argsort(rank[np.repeat(np.arange(len(rows)), qlens)], kind="stable")
    rows_o, computed_o, qlens_o = rows[order], computed[order], qlens[order]
    pos_o = positions[token_order]
    meta = _metadata(block_table, rows_o, computed_o, qlens_o, pos_o, block_size, device)
    return DraftBatch(order=order, token_order=token_order, positions=pos_o,
                      last=np.cumsum(qlens_o) - 1, metadata=meta)


def _metadata(block_table: np.ndarray, rows: np.ndarray, computed: np.ndarray,
              qlens: np.ndarray, positions: np.ndarray, bs: int,
              dev: torch.device) -> AttentionMetadata:
    slots = block_table[np.repeat(rows, qlens), positions // bs] * bs + positions % bs
    num_decodes = int((qlens == 1).sum())
    seq_lens = computed + qlens
    meta = AttentionMetadata(num_decode_tokens=num_decodes,
                             slot_mapping=torch.from_numpy(slots).to(dev), block_size=bs)
    if num_decodes:
        d = slice(0, num_decodes)
        tables = block_table[rows[d], :_cdiv(int(seq_lens[d].max()), bs)]
        meta.decode_block_tables = torch.from_numpy(np.ascontiguousarray(tables)).to(dev)
        meta.decode_seq_lens = torch.from_numpy(seq_lens[d].copy()).to(dev)
    if num_decodes < len(rows):
        p = slice(num_decodes, None)
        starts = np.cumsum(qlens) - qlens
        meta.prefill_query_starts = torch.from_numpy(starts[p].copy()).to(dev)
        meta.prefill_query_lens = torch.from_numpy(qlens[p].copy()).to(dev)
        meta.prefill_context_lens = torch.from_numpy(computed[p].copy()).to(dev)
        tables = block_table[rows[p], :_cdiv(int(seq_lens[p].max()), bs)]
        meta.prefill_block_tables = torch.from_numpy(np.ascontiguousarray(tables)).to(dev)
    return meta
