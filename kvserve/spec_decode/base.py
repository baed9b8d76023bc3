"""The proposer interface the SpecDecodeRunner calls (n-gram lookup, draft model)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

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
