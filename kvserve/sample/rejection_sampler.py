"""RejectionSampler: the final tokens of a step with speculative (draft) tokens.

Each sampling request b brings k_b >= 0 draft tokens; the target model scored k_b + 1
positions for it (one per draft, plus the bonus position after the last draft). The logits
arrive request-major, flattened over the whole step:

    rows of request b:  start_b = cu_num_draft[b-1] + b  ...  start_b + k_b   (the bonus row)

Per draft position j (Leviathan et al. / Chen et al., as vLLM's RejectionSampler):
    greedy rows:  accept while draft_j == argmax(p_j)
    random rows:  accept with probability min(1, p_j(d) / q_j(d)); q is one-hot for n-gram
                  drafts (accept with probability p_j(d)) or the draft model's probabilities
First rejection at j: the request's last token comes from norm(max(0, p_j - q_j)) (greedy:
argmax p_j); all k_b accepted: a bonus token from p_{k_b}. The tokens are then distributed
exactly as sampling one at a time from p.

p is the same distribution the plain Sampler samples from: the same logits processing
(allowed ids, logit_bias, min_tokens, bad words, penalties — with each position's earlier drafts
counted as output) then temperature, min_p, top-k/top-p. Everything is batched over the step;
the only Python loop is over requests that own a torch.Generator (per-request seeds).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import (apply_sampling_transforms, argmax, gather_logprobs,
                                    process_logits)

_SAMPLING_EPS = 1e-5
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class SampleLayout:
    """A step's scored logits rows: sampling request s owns rows [row_starts[s],
    row_starts[s] + num_drafts[s]] (its drafts' positions, then the bonus one). Without
    drafts, k = 0 everywhere: one row per request, the plain Sampler's layout."""
    logits_indices: np.ndarray      # token index of every scored row
    num_drafts: list[int]           # per sampling request
    draft_token_ids: list[int]      # flattened, request-major
    row_starts: np.ndarray          # per sampling request

    @staticmethod
    def make(req_ids: list[str], sample_idx: np.ndarray, query_ends: np.ndarray,
             spec_tokens: dict[str, list[int]]) -> "SampleLayout":
        """Request sample_idx[s] (of req_ids) ends its query at token query_ends[sample_idx[s]]
        and verifies spec_tokens.get(its id, []) there."""
        ends = query_ends[sample_idx]
        if not spec_tokens:
            return SampleLayout(logits_indices=ends - 1, num_drafts=[0] * len(sample_idx),
                                draft_token_ids=[], row_starts=np.arange(len(sample_idx)))
        drafts = [spec_tokens.get(req_ids[i], []) for i in sample_idx]
        k = np.fromiter((len(d) for d in drafts), np.int64, len(drafts))
        rows_per_req = k + 1
        row_starts = np.cumsum(rows_per_req) - rows_per_req
        owner = np.repeat(np.arange(len(k)), rows_per_req)
        offset = np.arange(int(rows_per_req.sum())) - row_starts[owner]
        logits_indices = (ends - 1 - k)[owner] + offset
        return SampleLayout(logits_indices=logits_indices, num_drafts=k.tolist(),
                            draft_token_ids=[t for d in drafts for t in d], row_starts=row_starts)


@dataclass
class SpecDecodeMetadata:
    """Where the draft tokens sit in the step's logits (built by the model runner)."""
    draft_token_ids: torch.Tensor        # [num_draft] int64, request-major
    num_draft_tokens: list[int]          # [B] k_b
    cu_num_draft_tokens: torch.Tensor    # [B] int64 inclusive cumulative sum of k_b
    target_logits_indices: torch.Tensor  # [num_draft] logits row scoring each draft token
    bonus_logits_indices: torch.Tensor   # [B] logits row of each request's bonus position
    max_spec_len: int

    @staticmethod
    def make(num_draft_tokens: list[int], draft_token_ids: list[int],
             device: torch.device) -> "SpecDecodeMetadata":
        k = torch.tensor(num_draft_tokens, dtype=torch.long)
        cu = torch.cumsum(k, 0)
        # Request b's rows start at cu[b-1] + b; its bonus row is start + k_b.
        starts = cu - k + torch.arange(len(num_draft_tokens))
        bonus = starts + k
        req_of_draft = torch.repeat_interleave(torch.arange(len(num_draft_tokens)), k)
        offset_in_req = torch.arange(int(cu[-1]) if len(cu) else 0) - (cu - k)[req_of_draft]
        target = starts[req_of_draft] + offset_in_req
        return SpecDecodeMetadata(
            draft_token_ids=torch.tensor(draft_token_ids, dtype=torch.long, device=device),
            num_draft_tokens=list(num_draft_tokens), cu_num_draft_tokens=cu.to(device),
            target_logits_indices=target.to(device), bonus_logits_indices=bonus.to(device),
            max_spec_len=max(num_draft_tokens, default=0))


@dataclass
class RejectionSamplerOutput:
    # [B, max_spec_len + 1]: accepted drafts then the recovered / bonus token, -1 after.
    output_token_ids: torch.Tensor
    num_sampled: torch.Tensor                 # [B] accepted drafts + 1
    # Per logits row (request-major, like the input) when logprobs were asked for: the row's
    # output token first, then the top-k of the raw logprobs; ranks of the output tokens.
    logprob_token_ids: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None
    sampled_token_ranks: Optional[torch.Tensor] = None


class RejectionSampler(nn.Module):

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata,
                spec: SpecDecodeMetadata, generators: dict[int, torch.Generator],
                draft_probs: Optional[torch.Tensor] = None) -> RejectionSamplerOutput:
        """logits [N, V]: target logits per row (N = num_draft + B), metadata per row;
        generators: request index -> its generator (seeded requests); draft_probs
        [num_draft, V] or None for one-hot drafts."""
        logits = logits.to(torch.float32)
        raw_logprobs = (logits.log_softmax(dim=-1)
                        if metadata.max_num_logprobs is not None else None)
        logits = process_logits(logits, metadata)
        output = self._sample(logits, metadata, spec, generators, draft_probs)
        if raw_logprobs is None:
            return output
        row_tokens = _row_tokens(output.output_token_ids, spec)
        ids, lps, ranks = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, row_tokens)
        output.logprob_token_ids, output.logprobs, output.sampled_token_ranks = ids, lps, ranks
        return output

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                spec: SpecDecodeMetadata, generators: dict[int, torch.Generator],
                draft_probs: Optional[torch.Tensor]) -> RejectionSamplerOutput:
        device = logits.device
        target_idx, bonus_idx = spec.target_logits_indices, spec.bonus_logits_indices
        draft = spec.draft_token_ids
        greedy_tokens = argmax(logits)                                 # [N]
        greedy_row = metadata.temperature.to(device) < _SAMPLING_EPS  # [N]

        accepted = draft == greedy_tokens[target_idx]
        recovered = greedy_tokens[target_idx]
        bonus = greedy_tokens[bonus_idx]
        if not metadata.all_greedy:
            probs = apply_sampling_transforms(logits, metadata).softmax(dim=-1)
            uniform, expo = _random_draws(probs.shape, spec, generators, device)
            p_draft = probs[target_idx].gather(1, draft[:, None])[:, 0]
            if draft_probs is None:   # one-hot q: accept with probability p(d)
                rand_accept = uniform < p_draft
                residual = probs[target_idx].scatter(1, draft[:, None], 0.0)
            else:
                q_draft = draft_probs.gather(1, draft[:, None])[:, 0]
                rand_accept = uniform * q_draft < p_draft
                residual = (probs[target_idx] - draft_probs).clamp_min_(0.0)
            # Exponential race: argmax(w / E) picks i with probability w_i / sum(w).
            rand_recovered = argmax(residual.div_(expo[target_idx]))
            rand_bonus = argmax(probs[bonus_idx] / expo[bonus_idx])
            g_draft = greedy_row[target_idx]
            accepted = torch.where(g_draft, accepted, rand_accept)
            recovered = torch.where(g_draft, recovered, rand_recovered)
            bonus = torch.where(greedy_row[bonus_idx], bonus, rand_bonus)
        return _assemble(accepted, draft, recovered, bonus, spec)


def _random_draws(shape: torch.Size, spec: SpecDecodeMetadata,
                  generators: dict[int, torch.Generator],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms per draft row and Exp(1) noise per logits row; a seeded request draws its
    own rows from its generator, so its tokens do not depend on the rest of the batch."""
    num_draft = spec.draft_token_ids.shape[0]
    uniform = torch.rand(num_draft, device=device)
    expo = torch.empty(shape, device=device).exponential_()
    if generators:
        cu = spec.cu_num_draft_tokens.tolist()
        for b, gen in generators.items():
            k = spec.num_draft_tokens[b]
            start_draft = cu[b] - k
            start_row = start_draft + b
            uniform[start_draft:start_draft + k] = torch.rand(k, generator=gen, device=device)
            expo[start_row:start_row + k + 1].exponential_(generator=gen)
    expo.clamp_min_(torch.finfo(expo.dtype).tiny)
    return uniform, expo


def _assemble(accepted: torch.Tensor, draft: torch.Tensor, recovered: torch.Tensor,
              bonus: torch.Tensor, spec: SpecDecodeMetadata) -> RejectionSamplerOutput:
    """Per request: drafts up to the first rejection, then the recovered (or bonus) token."""
    B, K = len(spec.num_draft_tokens), spec.max_spec_len
    device = draft.device
    k = torch.tensor(spec.num_draft_tokens, dtype=torch.long, device=device)
    cols = torch.arange(K + 1, device=device)
    in_draft = cols[:K][None, :] < k[:, None]                     # [B, K]
    acc_pad = torch.zeros(B, K, dtype=torch.bool, device=device)
    acc_pad[in_draft] = accepted
    num_accepted = acc_pad.to(torch.int64).cumprod(dim=1).sum(dim=1)   # [B]
    draft_pad = torch.full((B, K + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    draft_pad[:, :K][in_draft] = draft
    rec_pad = torch.zeros(B, K + 1, dtype=torch.long, device=device)
    rec_pad[:, :K][in_draft] = recovered
    last = torch.where(num_accepted < k, rec_pad.gather(1, num_accepted[:, None])[:, 0], bonus)
    out = torch.where(cols[None, :] < num_accepted[:, None], draft_pad,
                      torch.where(cols[None, :] == num_accepted[:, None], last[:, None],
                                  PLACEHOLDER_TOKEN_ID))
    return RejectionSamplerOutput(output_token_ids=out, num_sampled=num_accepted + 1)


def _row_tokens(output: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
    """The output token of every logits row (0 where the row produced none)."""
    device = output.device
    k = torch.tensor(spec.num_draft_tokens, dtype=torch.long, device=device)
    req = torch.repeat_interleave(torch.arange(len(k), device=device), k + 1)
    starts = torch.cumsum(k + 1, 0) - (k + 1)
    pos = torch.arange(req.shape[0], device=device) - starts[req]
    return output[req, pos].clamp_min(0)
