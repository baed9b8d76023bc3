"""EAGLE-1 proposer for Llama targets: runs the head of kvserve/model/eagle.py over the
target's hidden states (see there for the head itself and its checkpoint layout).

Per step (the target's hidden states of the step's tokens come from the model runner):
  1. the head runs over every fed request's positions p in [context, min(context + q, N - 1))
     (N: tokens after this step's sampling): its KV for those positions, and for drafting
     requests its output at p = N - 2 (the last accepted position, paired with the newly
     sampled token) -> draft 1;
  2. draft j + 1 (j >= 1): position N - 2 + j, input (embed(draft j), the head's own output
     from the previous position), as vLLM does.
Drafts are argmax: q is one-hot, so the rejection sampler stays exact. The head's KV is its own
tensor indexed by the target's block ids (draft_kv.py); the scheduler allocates
`num_speculative_tokens` lookahead slots, where step 2 writes.

A request whose step the head does not see (it is not drafting: the adaptive rule switched it
off) keeps stale head KV at those positions; only the acceptance rate suffers, never outputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from torch import nn

from kvserve.config import KVServeConfig
from kvserve.model.eagle import EagleHead, load_eagle_head
from kvserve.model.layers.embedding import ParallelLMHead
from kvserve.spec_decode.base import TargetHiddenStates
from kvserve.spec_decode.draft_kv import OwnKVProposer, make_draft_batch

if TYPE_CHECKING:
    from kvserve.worker.input_batch import InputBatch


class EagleProposer(OwnKVProposer):
    uses_target_hidden = True

    def __init__(self, config: KVServeConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self.head: Optional[EagleHead] = None
        self.embed_tokens: Optional[nn.Module] = None
        self.lm_head: Optional[ParallelLMHead] = None

    # ------------------------------------------------------------------ set-up
    def load_model(self, target_model: nn.Module) -> None:
        head = self.head = load_eagle_head(self.model_config, self.device)
        self.bind_attention(head)
        # The target's, unless the checkpoint brings its own (vLLM always uses the target's
        # embedding; see the module docstring).
        self.embed_tokens = (head.embed_tokens if head.embed_tokens is not None
                             else target_model.model.embed_tokens)
        self.lm_head = head.lm_head if head.lm_head is not None else target_model.lm_head

    def drop(self, req_ids: set[str]) -> None:
        pass   # no per-request state: the head's KV lives in the requests' blocks

    # ------------------------------------------------------------------ propose
    @torch.inference_mode()
    def propose(self, ib: InputBatch, rows: np.ndarray, num_drafts: np.ndarray,
                target: TargetHiddenStates) -> list[list[int]]:
        result: list[list[int]] = [[] for _ in rows]
        out, last_of_row = self._run_step_positions(ib, target)
        active = np.nonzero(num_drafts > 0)[0]
        if not len(active):
            return result
        rows_a, k = rows[active], num_drafts[active]
        last = last_of_row[rows_a]
        assert (last >= 0).all(), "a drafting request's step was not fed to the head"
        hidden = out[torch.from_numpy(last).to(self.device)]
        n = ib.num_tokens[rows_a].astype(np.int64)
        drafts = np.zeros((len(rows_a), int(k.max())), dtype=np.int64)
        drafts[:, 0] = self._argmax(hidden)
        for j in range(1, int(k.max())):
            on = np.nonzero(k > j)[0]
            on_t = torch.from_numpy(on).to(self.device)
            pos = n[on] - 2 + j
            step_out = self._forward(ib, rows_a[on], pos, np.ones(len(on), np.int64),
                                     drafts[on, j - 1], pos, hidden[on_t])
            hidden[on_t] = step_out
            drafts[on, j] = self._argmax(step_out)
        for i in range(len(rows_a)):
            result[active[i]] = drafts[i, :k[i]].tolist()
        return result

    def _run_step_positions(self, ib: InputBatch,
                            target: TargetHiddenStates) -> tuple[torch.Tensor, np.ndarray]:
        """Step 1: the head over the fed requests' positions of this step (those whose next
        token is known). Returns its outputs and, per input-batch row, the index of the row's
        last output (-1: not run)."""
        feed = target.feed if target.feed is not None else np.ones(len(target.rows), bool)
        rows, ctx = target.rows[feed], target.context_lens[feed]
        qlens, starts = target.query_lens[feed], target.query_starts[feed]
        n = ib.num_tokens[rows]
        m = np.maximum(np.minimum(ctx + qlens, n - 1) - ctx, 0)
        keep = m > 0
        rows, ctx, m, starts = rows[keep], ctx[keep], m[keep], starts[keep]
        last_of_row = np.full(ib.token_ids.shape[0], -1, dtype=np.int64)
        if not len(rows):
            return target.hidden[:0], last_of_row
        ends = np.cumsum(m)
        owner = np.repeat(np.arange(len(rows)), m)
        offsets = np.arange(int(ends[-1])) - (ends - m)[owner]
        positions = ctx[owner] + offsets
        input_ids = ib.token_ids[rows[owner], positions + 1]     # the token after each position
        hidden = target.hidden[torch.from_numpy(starts[owner] + offsets).to(self.device)]
        last_of_row[rows] = ends - 1
        return self._forward(ib, rows, ctx, m, input_ids, positions, hidden), last_of_row

    def _forward(self, ib: InputBatch, rows: np.ndarray, computed: np.ndarray,
                 qlens: np.ndarray, input_ids: np.ndarray, positions: np.ndarray,
                 hidden: torch.Tensor) -> torch.Tensor:
        """One head forward over `rows` (query tokens flattened in row order); returns the
        head's outputs in that order."""
        assert self.head is not None and self.embed_tokens is not None
        dev = self.device
        batch = make_draft_batch(ib.block_table, rows, computed, qlens, positions,
                                 self.block_size, dev)
        tok = torch.from_numpy(batch.token_order).to(dev)
        embeds = self.embed_tokens(torch.from_numpy(input_ids[batch.token_order]).to(dev))
        out_o = self.head(embeds, torch.from_numpy(batch.positions).to(dev), hidden[tok],
                          self.kv_caches, batch.metadata)
        out = torch.empty_like(out_o)
        out[tok] = out_o
        return out

    def _argmax(self, hidden: torch.Tensor) -> np.ndarray:
        assert self.lm_head is not None
        return self.lm_head.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
