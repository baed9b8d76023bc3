"""The worker-side Pooler: pooled hidden states of the requests whose prompt ends this step.

A step's hidden states are one flattened super-sequence; request i owns rows
[query_starts[i], query_starts[i] + query_lens[i]) and those rows are its prompt positions
[context_lens[i], context_lens[i] + query_lens[i]). A prompt split over several steps
(chunked prefill) is pooled over all its chunks:

    positions  0 ........ c0 ........ c1 ........ P      (P = prompt length)
    steps      |  chunk 1  |  chunk 2  |  chunk 3  |
    MEAN       sum of chunk rows carried in `_partial` until the chunk ending at P,
               then divided by P (not by the last chunk's length)
    CLS        row of position 0 (first chunk), kept until the end
    LAST       row of position P - 1 (in the final chunk)
    ALL        every chunk's rows, concatenated

Complete prompts in one step (the common case) are pooled with batched tensor operations;
only requests whose prompt spans steps keep per-request state. A request that restarts from
position 0 (preempted and recomputed) drops what it had.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig, PoolerConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.pooling_params import PoolingParams


class Pooler:
    def __init__(self, model_config: ModelConfig) -> None:
        cfg = model_config.pooler_config or PoolerConfig(pooling_type="LAST", normalize=True)
        self.pooling_type = cfg.pooling_type or "LAST"
        self.default_normalize = True if cfg.normalize is None else cfg.normalize
        self.default_dimensions = cfg.dimensions
        self._params: dict[str, PoolingParams] = {}
        # Requests part-way through a chunked prompt: MEAN's running sum, CLS's first row,
        # ALL's chunks so far.
        self._partial: dict[str, object] = {}

    # ------------------------------------------------------------------ membership
    def update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._params.pop(rid, None)
            self._partial.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self._params[new.req_id] = new.pooling_params or PoolingParams()
            self._partial.pop(new.req_id, None)

    # ------------------------------------------------------------------ pooling
    def pool(self, req_ids: list[str], hidden: torch.Tensor, query_starts: np.ndarray,
             query_lens: np.ndarray, context_lens: np.ndarray,
             prompt_lens: np.ndarray) -> list[Optional[torch.Tensor]]:
        """Per request: its pooled float32 vector (CPU) if its prompt ends this step, else None."""
        ends = context_lens + query_lens
        done = ends >= prompt_lens
        hidden = hidden.float()
        pooled = self._pool_rows(hidden, query_starts, query_lens)
        first, whole = context_lens == 0, done & (context_lens == 0)
        results: list[Optional[torch.Tensor]] = [None] * len(req_ids)
        for i in np.flatnonzero(~whole):          # only chunked prompts: rare, kept apart
            results[i] = self._chunk(req_ids[i], bool(first[i]), bool(done[i]), pooled[i],
                                     hidden, int(query_starts[i]), int(query_lens[i]),
                                     int(prompt_lens[i]))
        idx = np.flatnonzero(whole)
        if len(idx):
            if self.pooling_type == "MEAN":
                rows = pooled[idx] / torch.from_numpy(prompt_lens[idx]).to(hidden)[:, None]
            elif self.pooling_type == "ALL":
                rows = [pooled[i] for i in idx]
            else:
                rows = pooled[idx]
            for i, row in zip(idx, rows):
                results[i] = row
        return [None if r is None else self._finish(rid, r) for rid, r in zip(req_ids, results)]

    def _pool_rows(self, hidden: torch.Tensor, starts: np.ndarray, lens: np.ndarray) -> list:
        """Each request's contribution from this step's rows: LAST -> its last row, CLS -> its
        first row, MEAN -> the sum of its rows, ALL -> its rows (a list)."""
        if self.pooling_type == "LAST":
            return hidden[torch.from_numpy(starts + lens - 1).to(hidden.device)]
        if self.pooling_type == "CLS":
            return hidden[torch.from_numpy(starts).to(hidden.device)]
        if self.pooling_type == "MEAN":
            seg = torch.from_numpy(np.repeat(np.arange(len(lens)), lens)).to(hidden.device)
            sums = torch.zeros(len(lens), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            return sums.index_add_(0, seg, hidden[:int((starts + lens)[-1])])
        return [hidden[s:s + n] for s, n in zip(starts.tolist(), lens.tolist())]

    def _chunk(self, rid: str, first: bool, done: bool, part: torch.Tensor, hidden: torch.Tensor,
               start: int, n: int, prompt_len: int) -> Optional[torch.Tensor]:
        """Fold one chunk of a prompt that spans steps into its partial state."""
        if first:
            self._partial.pop(rid, None)
        prev = self._partial.get(rid)
        t = self.pooling_type
        if t == "CLS":
            acc = part if prev is None else prev
        elif t == "MEAN":
            acc = part if prev is None else prev + part
        elif t == "ALL":
            acc = part if prev is None else torch.cat([prev, part])
        else:
            acc = part
        if not done:
            self._partial[rid] = acc.clone() if t != "LAST" else None
            return None
        self._partial.pop(rid, None)
        return acc / prompt_len if t == "MEAN" else acc

    def _finish(self, rid: str, data: torch.Tensor) -> torch.Tensor:
        """The request's own `dimensions` (Matryoshka: truncate first) and normalisation."""
        params = self._params.get(rid) or PoolingParams()
        dims = params.dimensions or self.default_dimensions
        if dims is not None:
            data = data[..., :dims]
        normalize = self.default_normalize if params.normalize is None else params.normalize
        if normalize:
            data = F.normalize(data, p=2, dim=-1)
        return data.to("cpu", copy=True).contiguous()
