"""SpecDecodeRunner: the model runner's side of speculative decoding.

The ModelRunner calls it at two points of a step (it scores and samples the drafts itself:
plain sampling is the case without drafts, see sample.rejection_sampler.SampleLayout):

    update states:   write_drafts()      drafts go after each request's last token in the
                                         persistent batch (not counted in num_tokens)
    after the step:  propose()           next step's drafts, from the proposer, for the
                                         requests the scheduler's adaptive rule
                                         (adaptive.py) chose

A request with drafts runs 1 + k query tokens: its last sampled token and its drafts, at
positions num_tokens - 1 .. num_tokens - 1 + k, in the slots the scheduler allocated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from kvserve.core.sched_output import SchedulerOutput
from kvserve.spec_decode.base import Proposer, TargetHiddenStates
from kvserve.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from kvserve.worker.input_batch import InputBatch   # annotations only: worker is above


class SpecDecodeRunner:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 device: torch.device, proposer: "Proposer") -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.device = device
        self.proposer = proposer

    # ------------------------------------------------------------------ states
    def write_drafts(self, ib: InputBatch, so: SchedulerOutput) -> None:
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            row = ib.req_id_to_index[rid]
            n = ib.num_tokens[row]
            ib.token_ids[row, n:n + len(drafts)] = drafts

    def drop(self, req_ids: set[str]) -> None:
        self.proposer.drop(req_ids)

    # A proposer with its own model (draft_model) loads it and sizes its KV cache with the
    # target's: the same number of blocks, indexed by the same block ids.
    def load_model(self, target_model: Optional[torch.nn.Module] = None) -> None:
        if self.uses_target_hidden:        # EAGLE: shares the target's embedding / LM head
            self.proposer.load_model(target_model)
        elif hasattr(self.proposer, "load_model"):
            self.proposer.load_model()

    @property
    def uses_target_hidden(self) -> bool:
        """The proposer reads the target's hidden states of each step (EAGLE)."""
        return getattr(self.proposer, "uses_target_hidden", False)

    def kv_cache_bytes_per_block(self) -> int:
        get = getattr(self.proposer, "kv_cache_bytes_per_block", None)
        return get() if get is not None else 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if hasattr(self.proposer, "initialize_kv_cache"):
            self.proposer.initialize_kv_cache(num_blocks)

    # ------------------------------------------------------------------ propose
    def propose(self, ib: InputBatch, sample_rows: np.ndarray,
                draft_req_ids: Optional[set[str]], batch_size: int,
                target: Optional[TargetHiddenStates] = None,
                num_draft_tokens: Optional[int] = None) -> list[list[int]]:
        """Drafts for each sampling row (its tokens already include this step's) whose request
        is in `draft_req_ids` (None: every row). `target`: the step's hidden states, for
        proposers that read them (EAGLE). `num_draft_tokens`: the adaptive rule's k' (None:
        num_speculative_tokens)."""
        num_drafts = self._num_drafts(ib, sample_rows, draft_req_ids, num_draft_tokens)
        if target is not None:
            return self._propose_with_target(ib, sample_rows, num_drafts, batch_size, target)
        if not num_drafts.any():
            return [[] for _ in sample_rows]
        return self.proposer.propose(ib, sample_rows, num_drafts)

    def _num_drafts(self, ib: InputBatch, sample_rows: np.ndarray,
                    draft_req_ids: Optional[set[str]],
                    num_draft_tokens: Optional[int] = None) -> np.ndarray:
        k = min(num_draft_tokens or self.config.num_speculative_tokens,
                self.config.num_speculative_tokens)
        if draft_req_ids is None:
            num_drafts = np.full(len(sample_rows), k, dtype=np.int64)
        else:
            num_drafts = np.fromiter((k if ib.req_ids[r] in draft_req_ids else 0
                                      for r in sample_rows), np.int64, len(sample_rows))
        # Draft positions num_tokens .. num_tokens + k - 1 must stay below max_model_len.
        return np.minimum(num_drafts, self.max_model_len - ib.num_tokens[sample_rows])

    def _propose_with_target(self, ib: InputBatch, sample_rows: np.ndarray,
                             num_drafts: np.ndarray, batch_size: int,
                             target: TargetHiddenStates) -> list[list[int]]:
        """EAGLE: its head must see the step's positions of every request that drafts now or
        may draft later (prefill chunks), in steps where the batch rule allows drafting."""
        limit = self.config.disable_by_batch_size
        target.feed = ~target.sample_mask & (limit is None or batch_size <= limit)
        target.feed[target.sample_mask] = num_drafts > 0
        if not target.feed.any():
            return [[] for _ in sample_rows]
        return self.proposer.propose(ib, sample_rows, num_drafts, target)
