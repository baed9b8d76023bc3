"""InputBatch: the worker's persistent, row-per-request state.

Rows are kept dense (0..num_reqs-1): a removed request's row is filled by the last row
(`condense`). Token ids, block tables and sampling settings live in preallocated numpy arrays,
so preparing a step is a handful of vectorised index operations rather than per-request work.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from kvserve.core.sched_output import NewRequestData
from kvserve.sample.metadata import SamplingMetadata
from kvserve.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}

        R = max_num_reqs
        self.token_ids = np.zeros((R, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(R, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(R, dtype=np.int64)
        self.num_computed_tokens = np.zeros(R, dtype=np.int64)
        self.block_table = np.zeros((R, max_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(R, dtype=np.int64)
        # Sampling settings per row.
        self.temperature = np.zeros(R, dtype=np.float32)
        self.top_p = np.ones(R, dtype=np.float32)
        self.top_k = np.zeros(R, dtype=np.int64)
        self.min_p = np.zeros(R, dtype=np.float32)
        self.presence = np.zeros(R, dtype=np.float32)
        self.frequency = np.zeros(R, dtype=np.float32)
        self.repetition = np.ones(R, dtype=np.float32)
        self.params: list[Optional[SamplingParams]] = [None] * R
        self.generators: list[Optional[torch.Generator]] = [None] * R
        self.output_token_ids: list[list[int]] = [[] for _ in range(R)]
        self.eos_token_ids: list[set[int]] = [set() for _ in range(R)]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # ------------------------------------------------------------------ membership
    def add_request(self, req: NewRequestData) -> int:
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"InputBatch is full ({self.max_num_reqs} requests).")
        self.req_ids.append(req.req_id)
        self.req_id_to_index[req.req_id] = row
        n = len(req.token_ids)
        self.token_ids[row, :n] = req.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, req.block_ids)
        p = req.sampling_params
        self.params[row] = p
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.presence[row] = p.presence_penalty
        self.frequency[row] = p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.generators[row] = torch.Generator(device=self.device) if p.seed is not None else None
        self.eos_token_ids[row] = set(req.eos_token_ids)
        self.output_token_ids[row] = list(req.token_ids[req.num_prompt_tokens:])
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start:start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def remove_requests(self, req_ids: set[str]) -> None:
        """Remove requests and keep rows dense by moving the last rows into the holes."""
        for rid in req_ids:
            row = self.req_id_to_index.pop(rid, None)
            if row is None:
                continue
            last = len(self.req_ids) - 1
            if row != last:
                self._move_row(last, row)
            self.req_ids.pop()
            self.params[last] = None
            self.generators[last] = None
            self.output_token_ids[last] = []

    def _move_row(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        self.req_ids[dst] = rid
        self.req_id_to_index[rid] = dst
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                    self.num_blocks, self.temperature, self.top_p, self.top_k, self.min_p,
                    self.presence, self.frequency, self.repetition):
            arr[dst] = arr[src]
        self.params[dst] = self.params[src]
        self.generators[dst] = self.generators[src]
        self.eos_token_ids[dst] = self.eos_token_ids[src]
        self.output_token_ids[dst] = self.output_token_ids[src]

    def append_token(self, row: int, token: int) -> None:
        n = self.num_tokens[row]
        self.token_ids[row, n] = token
        self.num_tokens[row] = n + 1
        self.output_token_ids[row].append(token)

    # ------------------------------------------------------------------ sampling
    def make_sampling_metadata(self, rows: np.ndarray,
                               draft_prefixes: Optional[list[list[int]]] = None) -> SamplingMetadata:
        """Sampling settings for `rows` (the rows that sample this step, in logits order).

        Speculative decoding passes a row once per scored position, with `draft_prefixes[i]`
        the drafts before that position: they count as output (penalties, min_tokens, bad
        words) exactly as they would had they been sampled one at a time."""
        dev = self.device
        if draft_prefixes is None:
            outputs = [self.output_token_ids[r] for r in rows]
        else:
            outputs = [self.output_token_ids[r] + d for r, d in zip(rows, draft_prefixes)]
        temp = self.temperature[rows]
        greedy = temp == 0.0
        top_p, top_k, min_p = self.top_p[rows], self.top_k[rows], self.min_p[rows]
        params = [self.params[r] for r in rows]
        generators = {}
        for i, r in enumerate(rows):
            gen = self.generators[r]
            if gen is not None:
                # Seed from (request seed, output position): a seeded request samples the same
                # tokens whatever its batch, and also after preemption and recompute.
                gen.manual_seed(_position_seed(params[i].seed, len(outputs[i])))
                generators[i] = gen
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        max_lp: Optional[int] = None
        if logprob_counts:
            max_lp = -1 if -1 in logprob_counts else max(logprob_counts)

        presence, frequency, repetition = self.presence[rows], self.frequency[rows], self.repetition[rows]
        use_penalties = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
        prompt_ids = None
        if use_penalties:
            max_prompt = int(self.num_prompt_tokens[rows].max())
            prompt = np.full((len(rows), max_prompt), self.vocab_size, dtype=np.int64)
            for i, r in enumerate(rows):
                n = self.num_prompt_tokens[r]
                prompt[i, :n] = self.token_ids[r, :n]
            prompt_ids = torch.from_numpy(prompt).to(dev)

        allowed_mask = None
        if any(p.allowed_token_ids for p in params):
            allowed_mask = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool, device=dev)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    allowed_mask[i] = True
                    allowed_mask[i, p.allowed_token_ids] = False
        min_tokens = {}
        for i, (r, p) in enumerate(zip(rows, params)):
            if p.min_tokens and len(outputs[i]) < p.min_tokens:
                forbid = set(p.stop_token_ids or [])
                if not p.ignore_eos:
                    forbid |= self.eos_token_ids[r]
                min_tokens[i] = forbid
        bad_words = {i: (p.bad_words_token_ids, outputs[i])
                     for i, p in enumerate(params) if p.bad_words_token_ids}

        return SamplingMetadata(
            temperature=torch.from_numpy(temp.copy()).to(dev),
            all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()),
            top_p=None if (top_p == 1.0).all() else torch.from_numpy(top_p.copy()).to(dev),
            top_k=None if (top_k == 0).all() else torch.from_numpy(top_k.copy()).to(dev),
            min_p=None if (min_p == 0.0).all() else torch.from_numpy(min_p.copy()).to(dev),
            generators=generators, max_num_logprobs=max_lp,
            presence_penalties=torch.from_numpy(presence.copy()).to(dev) if use_penalties else None,
            frequency_penalties=torch.from_numpy(frequency.copy()).to(dev) if use_penalties else None,
            repetition_penalties=torch.from_numpy(repetition.copy()).to(dev) if use_penalties else None,
            prompt_token_ids=prompt_ids,
            output_token_ids=outputs if use_penalties else [],
            logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else [],
            allowed_token_ids_mask=allowed_mask,
            min_tokens=min_tokens, bad_words=bad_words)


def _position_seed(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (1 << 63)
