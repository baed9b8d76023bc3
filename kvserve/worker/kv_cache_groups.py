"""The worker's side of the hybrid KV cache (core/kv_cache_coordinator.py): shared KV tensors,
per-group block tables and per-group attention metadata.

Groups have (at most) `group_size` layers each; the i-th layer of every group writes the i-th
tensor, so a block id is one page of `group_size` layers whichever group the scheduler gave it
to, and the pool's blocks are sized for `group_size` layers, not all of them:

    tensors      T0        T1
    full group   layer 5   layer 11
    local 0      layer 0   layer 1        a block id b addresses T0[b] and T1[b]; only the
    local 1      layer 2   layer 3        group holding b (one at a time) reads or writes it
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from kvserve.attention import CommonAttentionMetadata
from kvserve.config import KVCacheGroupSpec
from kvserve.model.huge_pages import zeroed_kv_caches


def shared_kv_caches(groups: Sequence[KVCacheGroupSpec], num_layers: int,
                     shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> list[torch.Tensor]:
    """Per layer its KV tensor; layers at the same index of different groups share one."""
    size = max(len(g.layer_ids) for g in groups)
    tensors = zeroed_kv_caches(shape, dtype, device, size)
    caches: list[Any] = [None] * num_layers
    for group in groups:
        for i, layer in enumerate(group.layer_ids):
            caches[layer] = tensors[i]
    if any(c is None for c in caches):
        raise ValueError(f"KV cache groups {groups} do not cover the model's {num_layers} layers")
    return caches


def bind_kv_cache_groups(model: nn.Module, groups: Sequence[KVCacheGroupSpec]) -> None:
    """Tell each Attention layer (in model order, one per decoder layer) its group, and check
    that the model's windows are the groups' (the scheduler frees blocks by them)."""
    from kvserve.model.layers.attention import Attention
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for g, group in enumerate(groups):
        for layer_id in group.layer_ids:
            if layer_id >= len(layers):
                raise ValueError(f"KV cache group {g} names layer {layer_id}; the model has "
                                 f"{len(layers)} attention layers")
            attn = layers[layer_id]
            attn.kv_cache_group = g
            if attn.sliding_window != group.sliding_window:
                raise ValueError(f"layer {layer_id}: window {attn.sliding_window}, its KV cache "
                                 f"group's {group.sliding_window}")


def build_group_metadata(backend: Any, common: CommonAttentionMetadata,
                         block_tables: np.ndarray, rows: np.ndarray, tok_rows: np.ndarray,
                         positions: np.ndarray) -> Any:
    """One backend metadata per group (a list; a single group's alone): the same tokens and
    lengths, each group's own block table and slot mapping."""
    bs = common.block_size
    width = common.block_table.shape[1]
    metas = []
    for g in range(block_tables.shape[0]):
        table = block_tables[g]
        slots = table[tok_rows, positions // bs] * bs + positions % bs
        metas.append(backend.build_metadata(dataclasses.replace(
            common, block_table=table[rows, :width], slot_mapping=slots)))
    return metas if len(metas) > 1 else metas[0]
