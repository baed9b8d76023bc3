"""Paged KV for a proposer's own layers (draft model, EAGLE head): its KV tensors are indexed
by the target's block ids, so a batch of proposer queries is addressed with the target's
block table and slot mapping. One helper builds that batch: rows reordered with single-token
queries (decodes) first, as the attention kernels expect, and the AttentionMetadata.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model.layers.attention import AttentionMetadata


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
