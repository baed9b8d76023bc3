"""Draft-model proposer: a smaller checkpoint with the target's tokenizer proposes k tokens
greedily (argmax: a deterministic proposal, so q is one-hot and the rejection sampler stays
exact), one batched forward per draft position.

Its KV cache is its own tensors, indexed by the target's block ids and slot mapping: a
request's block table covers the draft's positions too, because the scheduler allocates
`num_speculative_tokens` lookahead slots for every request (kv_cache_manager.allocate_slots).

    draft KV valid for positions < valid[req]     (everything before the last step's drafts)
    propose: feed positions [valid, num_tokens)   (the step's new tokens; all of them for a new
                                                   or resumed request) -> draft 0
             then k - 1 single-token steps        -> drafts 1..k-1
             valid = num_tokens                   (the fed drafts may be rejected: their KV is
                                                   rewritten next time)

A request the adaptive rule keeps from drafting runs nothing here (the draft model's cost is
then zero); when it drafts again, the first draft forward catches its KV up over every token
it missed, in the same batched forward as the other requests' new tokens.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from kvserve.config import KVServeConfig
from kvserve.spec_decode.draft_kv import OwnKVProposer, make_draft_batch

if TYPE_CHECKING:
    from kvserve.worker.input_batch import InputBatch   # annotations only: worker is above


class DraftModelProposer(OwnKVProposer):
    def __init__(self, config: KVServeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.model: Optional[torch.nn.Module] = None
        self._valid: dict[str, int] = {}

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        from kvserve.model.loader import load_model
        self.model = load_model(self.model_config, self.device)
        self.bind_attention(self.model)

    def drop(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            self._valid.pop(rid, None)

    # ------------------------------------------------------------------ propose
    def propose(self, ib: InputBatch, rows: np.ndarray, num_drafts: np.ndarray) -> list[list[int]]:
        result: list[list[int]] = [[] for _ in rows]
        active = np.nonzero(num_drafts > 0)[0]
        if not len(active):
            return result
        rows_a, k = rows[active], num_drafts[active]
        req_ids = [ib.req_ids[r] for r in rows_a]
        n = ib.num_tokens[rows_a].astype(np.int64)
        valid = np.minimum(np.fromiter((self._valid.get(r, 0) for r in req_ids), np.int64,
                                       len(req_ids)), n - 1)
        qlens = n - valid
        owner = np.repeat(np.arange(len(rows_a)), qlens)
        positions = valid[owner] + (np.arange(int(qlens.sum())) - (np.cumsum(qlens) - qlens)[owner])
        input_ids = ib.token_ids[rows_a[owner], positions]
        drafts = np.zeros((len(rows_a), int(k.max())), dtype=np.int64)
        drafts[:, 0] = self._step(ib, rows_a, valid, qlens, input_ids, positions)
        for j in range(1, int(k.max())):
            on = np.nonzero(k > j)[0]
            pos = n[on] + j - 1
            drafts[on, j] = self._step(ib, rows_a[on], pos, np.ones(len(on), np.int64),
                                       drafts[on, j - 1], pos)
        for i, rid in enumerate(req_ids):
            self._valid[rid] = int(n[i])
            result[active[i]] = drafts[i, :k[i]].tolist()
        return result

    @torch.inference_mode()
    def _step(self, ib: InputBatch, rows: np.ndarray, computed: np.ndarray, qlens: np.ndarray,
              input_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One draft forward over `rows` (query tokens flattened in row order); returns the
        argmax token after each row's last query token."""
        assert self.model is not None
        batch = make_draft_batch(ib.block_table, rows, computed, qlens, positions,
                                 self.block_size, self.device)
        hidden = self.model(torch.from_numpy(input_ids[batch.token_order]).to(self.device),
                            torch.from_numpy(batch.positions).to(self.device), self.kv_caches,
                            batch.metadata)
        last = torch.from_numpy(batch.last).to(self.device)
        tokens_o = self.model.compute_logits(hidden[last]).argmax(dim=-1).cpu().numpy()
        tokens = np.empty_like(tokens_o)
        tokens[batch.order] = tokens_o
        return tokens
