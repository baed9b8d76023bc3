"""The proposer interface the SpecDecodeRunner calls (n-gram lookup, draft model, EAGLE)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from kvserve.worker.input_batch import InputBatch


class Proposer(Protocol):
    def propose(self, ib: "InputBatch", rows: np.ndarray,
                num_drafts: np.ndarray) -> list[list[int]]:
        """Up to num_drafts[i] draft tokens to follow input-batch row rows[i] (whose tokens
        include this step's sampled ones); num_drafts[i] == 0: none."""
        ...

    def drop(self, req_ids: set[str]) -> None:
        """Forget finished or preempted requests."""
        ...


@dataclass
class TargetHiddenStates:
    """The target's step, for proposers that read its last-layer hidden states (EAGLE):
    step request i (input-batch row rows[i]) ran query tokens at positions
    context_lens[i] .. context_lens[i] + query_lens[i] - 1, whose final hidden states are
    hidden[query_starts[i] : query_starts[i] + query_lens[i]]."""
    rows: np.ndarray
    context_lens: np.ndarray
    query_lens: np.ndarray
    query_starts: np.ndarray
    sample_mask: np.ndarray        # step request i samples this step
    hidden: torch.Tensor           # [num_step_tokens, hidden_size]
    # Step requests whose positions the proposer must process (set by the SpecDecodeRunner).
    feed: np.ndarray | None = None
