"""SamplingMetadata: the batched, tensorised sampling settings of one step.

Built by the ModelRunner from its persistent input batch; rows are in the order of the logits
passed to the Sampler (one row per request that samples this step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor                # [B] float32; 0.0 marks a greedy row
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]            # [B] float32, None when every row is 1.0
    top_k: Optional[torch.Tensor]            # [B] int64, None when no row uses it (0 = off)
    min_p: Optional[torch.Tensor]            # [B] float32, None when every row is 0.0
    # Rows with a per-request seed: row index -> torch.Generator (state advances each step).
    generators: dict[int, torch.Generator]
    max_num_logprobs: Optional[int]          # None: no row wants logprobs; -1 means full vocab
    # Penalties; None when no row uses any.
    presence_penalties: Optional[torch.Tensor] = None     # [B] float32
    frequency_penalties: Optional[torch.Tensor] = None    # [B] float32
    repetition_penalties: Optional[torch.Tensor] = None   # [B] float32
    prompt_token_ids: Optional[torch.Tensor] = None       # [B, P] int64, padded with vocab_size
    output_token_ids: list[list[int]] = field(default_factory=list)  # [B] python lists
    # Sparse extras.
    logit_bias: list[Optional[dict[int, float]]] = field(default_factory=list)  # [B] or []
    allowed_token_ids_mask: Optional[torch.Tensor] = None  # [B, V] bool, True = NOT allowed
    # Rows still under min_tokens: row index -> token ids to forbid (stop tokens, EOS).
    min_tokens: dict[int, set[int]] = field(default_factory=dict)
    # Rows with bad_words: row index -> (forbidden token sequences, the row's output ids).
    bad_words: dict[int, tuple[list[list[int]], list[int]]] = field(default_factory=dict)

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor          # [B] int64
    # When max_num_logprobs is set: ids [B, k+1] (sampled first), logprobs [B, k+1], ranks [B]
    logprob_token_ids: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None
    sampled_token_ranks: Optional[torch.Tensor] = None
