"""Vocabulary-parallel token embedding and LM head.

The vocabulary is split into tp_size contiguous ranges of ceil(vocab / tp_size) rows; the last
range may be partly padding (zero rows, sliced off the logits).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.parallel_state import (get_tp_rank, get_tp_world_size,
                                                tensor_model_parallel_all_gather,
                                                tensor_model_parallel_all_reduce)
from kvserve.model.layers.linear import copy_checked, tile_streamed_weight
from kvserve.ops.linear import (TILE_ROWS, is_tiled, pack_weight, packed_linear,
                                small_batch_or_packed_linear)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # Activations' dtype when it differs from the weight's (compute_dtype.py); None: same.
        self.compute_dtype: Optional[torch.dtype] = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        assert shard_id is None, shard_id
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"Checkpoint embedding has {loaded_weight.shape[0]} rows; the config "
                             f"says vocab_size={self.num_embeddings}.")
        n = self.vocab_end - self.vocab_start
        copy_checked(param.data[:n], loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self._lookup(input_ids)
        return out if self.compute_dtype in (None, out.dtype) else out.to(self.compute_dtype)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._rows(input_ids)
        # Ids outside this rank's range look up row 0 and are zeroed; the all-reduce then
        # leaves exactly the owning rank's row for every token.
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = self._rows(local_ids).masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if is_tiled(w):     # shared with a tied LM head that keeps it tiled (ParallelLMHead)
            return w[ids // TILE_ROWS, :, ids % TILE_ROWS, :].reshape(*ids.shape, -1)
        return F.embedding(ids, w)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, shard=[{self.vocab_start}, "
                f"{self.vocab_end}), embedding_dim={self.embedding_dim}")


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection. Tied models share the embedding's weight Parameter."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tied = False
        self.weight_packed: Optional[torch.Tensor] = None
        self.float32_copy = False     # as LinearBase.float32_copy
        self.small_batch_copy = False  # as LinearBase.small_batch_copy

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        self.weight = embed_tokens.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        """On CPU, a oneDNN-prepacked copy for compute_logits (see ops.linear); the plain
        weight is dropped unless the embedding shares it or small_batch_copy is set. A 16-bit
        weight with float32 math stays as it is (ops.linear widens it). A weight that the
        small-batch kernel streams is tiled where ops.linear.tile_weight applies, a tied one
        too: the embedding then looks its rows up in the tiles (VocabParallelEmbedding._rows)."""
        if self.compute_dtype not in (None, self.weight.dtype):
            if self.float32_copy:
                self.weight_packed = pack_weight(self.weight.to(self.compute_dtype))
            tile_streamed_weight(self, self.compute_dtype)
            return
        packed = pack_weight(self.weight)
        if packed is not None:
            self.weight_packed = packed
            if self.small_batch_copy:
                tile_streamed_weight(self, self.weight.dtype)
            elif not self.tied:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> float32 logits [N, vocab] over the full vocabulary."""
        widened = self.compute_dtype not in (None, self.weight.dtype)
        if self.weight_packed is not None and not widened and not self.small_batch_copy:
            logits = packed_linear(hidden_states, self.weight_packed)
        else:
            logits = small_batch_or_packed_linear(hidden_states, self.weight, self.weight_packed)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; call compute_logits(hidden_states).")
