"""Vocabulary-parallel token embedding and LM head.

The vocabulary is split into tp_size contiguous ranges of ceil(vocab / tp_size) rows; the last
range may be partly padding (zero rows, sliced off the logits). Lookups and the LM head's
matmul go through the weight's object (ops.cpu_weight), one for a tied head and embedding.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn

from kvserve.distributed.parallel_state import (get_tp_rank, get_tp_world_size,
                                                tensor_model_parallel_all_gather,
                                                tensor_model_parallel_all_reduce)
from kvserve.model.layers.linear import copy_checked, copy_rows
from kvserve.ops.cpu_weight import CpuLinearWeight
from kvserve.ops.quant.weight import QuantizedRows


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
        # Plain until the loader applies the model's weight plan (ops.cpu_weight).
        self.linear_weight = CpuLinearWeight(self.weight, self.weight.dtype)
        # Multi-LoRA (kvserve.lora.layers.LoRAEmbedding / LoRALogits), set with --enable-lora.
        self.lora: Optional[Any] = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: Optional[Union[int, str]] = None) -> None:
        assert shard_id is None, shard_id
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"Checkpoint embedding has {loaded_weight.shape[0]} rows; the config "
                             f"says vocab_size={self.num_embeddings}.")
        n = self.vocab_end - self.vocab_start
        if isinstance(loaded_weight, QuantizedRows):    # kept packed: ops.cpu_weight
            rows = loaded_weight.narrow(0, self.vocab_start, n).zero_padded(self.shard_size)
            copy_rows(param, rows)
            return
        copy_checked(param.data[:n], loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = self.linear_weight.rows(input_ids)
        else:
            # Ids outside this rank's range look up row 0 and are zeroed; the all-reduce then
            # leaves exactly the owning rank's row for every token.
            in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
            out = self.linear_weight.rows(local_ids).masked_fill_(~in_range.unsqueeze(-1), 0)
            out = tensor_model_parallel_all_reduce(out)
        act = self.linear_weight.act_dtype     # float32 rows of a 16-bit (widened) weight
        out = out if out.dtype == act else out.to(act)
        return out if self.lora is None else self.lora.apply(input_ids, out)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, shard=[{self.vocab_start}, "
                f"{self.vocab_end}), embedding_dim={self.embedding_dim}")


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection. Tied models share the embedding's weight Parameter."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        self.weight = embed_tokens.weight
        self.linear_weight = embed_tokens.linear_weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] -> float32 logits [N, vocab] over the full vocabulary."""
        logits = self.linear_weight.matmul(hidden_states)
        if self.lora is not None:
            logits = self.lora.apply(hidden_states, logits)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        return logits[..., :self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; call compute_logits(hidden_states).")
