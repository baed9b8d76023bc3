"""The "never slower" rule: who drafts in the next step.

1. Batch size: no request drafts in a step that ran more than `disable_by_batch_size`
   requests. Verifying k extra tokens per request is nearly free only while a step is
   memory-bound (weights streamed once for the batch); a large batch is compute-bound, and
   every rejected draft token is then a full token of wasted compute.
2. Acceptance: each request keeps an EMA (weight 0.3) of its per-step acceptance rate
   (accepted / drafted), starting at 1. Below `min_acceptance_rate` it stops drafting, and
   drafts again once every `probe_interval` steps to see whether its text became
   predictable (the probe's result moves the EMA back up when it is).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_EMA_WEIGHT = 0.3


@dataclass
class _ReqState:
    ema: float = 1.0
    steps_since_draft: int = 0


class SpecDecodeController:
    def __init__(self, num_speculative_tokens: int, disable_by_batch_size: int | None,
                 min_acceptance_rate: float, probe_interval: int) -> None:
        self.k = num_speculative_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_acceptance_rate = min_acceptance_rate
        self.probe_interval = probe_interval
        self._state: dict[str, _ReqState] = {}

    def record(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        st = self._state.setdefault(req_id, _ReqState())
        st.ema = (1 - _EMA_WEIGHT) * st.ema + _EMA_WEIGHT * (num_accepted / num_drafted)

    def num_drafts(self, req_ids: list[str], batch_size: int) -> np.ndarray:
        """Draft tokens each of `req_ids` may propose for the next step."""
        out = np.zeros(len(req_ids), dtype=np.int64)
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return out
        for i, rid in enumerate(req_ids):
            st = self._state.setdefault(rid, _ReqState())
            st.steps_since_draft += 1
            if st.ema >= self.min_acceptance_rate or st.steps_since_draft >= self.probe_interval:
                out[i] = self.k
                st.steps_since_draft = 0
        return out

    def drop(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._state.pop(rid, None)
