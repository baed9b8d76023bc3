"""The batched Sampler: logits [B, V] + SamplingMetadata -> sampled tokens (+ logprobs).

Order (as vLLM V1's Sampler):
    float32 -> raw logprobs (if wanted) -> allowed_token_ids / logit_bias / min_tokens
    -> penalties -> greedy argmax | temperature -> min_p -> top_k/top_p -> exponential race
    -> greedy/random combine -> top-k logprobs of the raw logprobs, sampled token first.

Every step works on the whole batch; the only per-row Python loops are over the sparse host
inputs (logit_bias entries, min_tokens rows) and over rows that own a torch.Generator.
No step reads a device value back to the host. The caller's logits are never modified.
"""
from __future__ import annotations

from itertools import chain
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from kvserve.sample.metadata import SamplerOutput, SamplingMetadata

_SAMPLING_EPS = 1e-5  # temperature below this is greedy (same threshold as SamplingParams)


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # Out-of-place from here on: `.to` may hand back the caller's tensor unchanged.
        logits = logits.to(torch.float32)
        # vLLM's default "raw_logprobs": what the model said, before any processing.
        raw_logprobs = (logits.log_softmax(dim=-1)
                        if metadata.max_num_logprobs is not None else None)

        logits = process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        ids, logprobs, ranks = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprob_token_ids=ids,
                             logprobs=logprobs, sampled_token_ranks=ranks)

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Processed float32 logits [B, V] -> token ids [B] int64."""
        greedy = None if metadata.all_random else argmax(logits)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        logits = apply_sampling_transforms(logits, metadata)
        sampled = random_sample(logits.softmax(dim=-1), metadata.generators)
        if greedy is None:
            return sampled
        temperature = metadata.temperature.to(logits.device, non_blocking=True)
        return torch.where(temperature < _SAMPLING_EPS, greedy, sampled)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1): the first maximum of each row, NaN counting as the maximum. On CPU
    numpy's argmax does the same (same index, ties and NaN included) many times faster:
    torch's took 92 us for one 49,152-wide row (SmolLM2's vocabulary) and 1.3 ms for 16 rows
    (Zen 3, one thread; several ms with two), numpy's 7 and 136 us."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.dim() != 2
            or x.requires_grad):
        return x.argmax(dim=-1)
    return torch.from_numpy(x.numpy().argmax(axis=-1).astype(np.int64, copy=False))


# ---------------------------------------------------------------- constraints and penalties
def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Constraints and penalties, in vLLM's order: what greedy takes the argmax of and what
    temperature / min_p / top-k / top-p then shape (shared with the rejection sampler)."""
    logits = apply_allowed_token_ids(logits, metadata.allowed_token_ids_mask)
    logits = apply_logit_bias(logits, metadata.logit_bias)
    logits = apply_min_tokens(logits, metadata.min_tokens)
    logits = apply_bad_words(logits, metadata.bad_words)
    if not metadata.no_penalties:
        logits = apply_penalties(logits, metadata)
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """`mask` [B, V] bool is True where a token is NOT allowed."""
    if mask is None:
        return logits
    return logits.masked_fill(mask.to(logits.device, non_blocking=True), float("-inf"))


def apply_logit_bias(logits: torch.Tensor,
                     logit_bias: list[Optional[dict[int, float]]]) -> torch.Tensor:
    """Sparse add: one index_put over every (row, token, bias) of the batch."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, bias in enumerate(logit_bias):
        if bias:
            rows.extend([i] * len(bias))
            cols.extend(bias.keys())
            vals.extend(bias.values())
    if not rows:
        return logits
    return logits.index_put(_host_indices(rows, cols, logits.device),
                            _to_device(torch.tensor(vals, dtype=logits.dtype), logits.device),
                            accumulate=True)


def apply_bad_words(logits: torch.Tensor,
                    bad_words: dict[int, tuple[list[list[int]], list[int]]]) -> torch.Tensor:
    """Forbid the token that would complete a bad word: a one-token word always, a longer one
    when the row's last output tokens are the word's other tokens (vLLM's rule; only rows
    that have bad_words are visited)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, (sequences, output) in bad_words.items():
        for seq in sequences:
            prefix = len(seq) - 1
            if prefix > len(output):
                continue
            if prefix == 0 or output[-prefix:] == seq[:-1]:
                rows.append(i)
                cols.append(seq[-1])
    if not rows:
        return logits
    return logits.index_put(_host_indices(rows, cols, logits.device),
                            torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def apply_min_tokens(logits: torch.Tensor, min_tokens: dict[int, set[int]]) -> torch.Tensor:
    """Rows still under min_tokens may not pick their stop ids (EOS included)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, stop_ids in min_tokens.items():
        rows.extend([i] * len(stop_ids))
        cols.extend(stop_ids)
    if not rows:
        return logits
    return logits.index_put(_host_indices(rows, cols, logits.device),
                            torch.tensor(float("-inf"), device=logits.device))


def get_token_bin_counts_and_mask(tokens: torch.Tensor, vocab_size: int,
                                  num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, L] padded with vocab_size -> counts [B, V] int64 and counts > 0."""
    # One extra column catches the padding id, then is dropped.
    bin_counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.long, device=tokens.device)
    bin_counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    bin_counts = bin_counts[:, :vocab_size]
    return bin_counts, bin_counts > 0


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt or output tokens; HF/vLLM rule), then frequency and presence
    (output tokens only), as vLLM's `apply_penalties`. Rows at the defaults are unchanged."""
    num_seqs, vocab_size = logits.shape
    device = logits.device
    assert metadata.presence_penalties is not None
    assert metadata.frequency_penalties is not None
    assert metadata.repetition_penalties is not None
    output_tokens = _pad_token_lists(metadata.output_token_ids, num_seqs, vocab_size, device)
    output_counts, output_mask = get_token_bin_counts_and_mask(output_tokens, vocab_size,
                                                               num_seqs)
    seen = output_mask
    if metadata.prompt_token_ids is not None:
        _, prompt_mask = get_token_bin_counts_and_mask(
            metadata.prompt_token_ids.to(device, non_blocking=True), vocab_size, num_seqs)
        seen = seen | prompt_mask

    rep = metadata.repetition_penalties.to(device, non_blocking=True).unsqueeze(1)
    rep = torch.where(seen, rep, 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    freq = metadata.frequency_penalties.to(device, non_blocking=True).unsqueeze(1)
    pres = metadata.presence_penalties.to(device, non_blocking=True).unsqueeze(1)
    logits = logits - freq * output_counts
    return logits - pres * output_mask


# ---------------------------------------------------------------- random-row transforms
def apply_sampling_transforms(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min_p, then top_k/top_p: the logits the random rows sample from
    (tokens they may not pick are -inf). Greedy rows pass through with temperature 1."""
    logits = apply_temperature(logits, metadata.temperature, metadata.all_random)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor,
                      all_random: bool) -> torch.Tensor:
    temperature = temperature.to(logits.device, non_blocking=True)
    if not all_random:
        # Greedy rows (temperature 0) take the argmax elsewhere; avoid dividing by zero.
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
    return logits / temperature.unsqueeze(1)  # new tensor: later steps may work in place


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop tokens whose probability is below min_p * the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.to(logits.device).unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: Optional[torch.Tensor],
                      p: Optional[torch.Tensor]) -> torch.Tensor:
    """vLLM's `apply_top_k_top_p`: one ascending sort, mask in sorted order, scatter back.

    top_k keeps every token >= the k-th largest (ties kept); k <= 0 (or >= V) is off.
    top_p drops the low tail whose cumulative probability is <= 1 - p, so a token survives
    when the tokens strictly above it hold less than p; the top token always survives.
    With neither set the logits are returned untouched, without a sort. Writes into
    `logits` (the fresh tensor from apply_temperature in the Sampler).
    """
    if k is None and p is None:
        return logits
    vocab_size = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k = k.to(logits.device, non_blocking=True)
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        kth_largest = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth_largest, float("-inf"))
    if p is not None:
        p = p.to(logits.device, non_blocking=True)
        probs_sum = logits_sort.softmax(dim=-1).cumsum_(dim=-1)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(1)
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, float("-inf"))
    return logits.scatter_(-1, logits_idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(probs / q), q ~ Exp(1), picks token i with probability
    probs[i]. Rows with their own generator draw their own q, so a seeded row's token
    depends only on its own seed and logits, not on the rest of the batch."""
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for i, generator in generators.items():
        q[i].exponential_(generator=generator)
    # An exact 0 draw would make 0/0 = NaN on a masked token, and argmax picks NaN.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return argmax(probs.div_(q))


# ---------------------------------------------------------------- logprobs
def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-`num_logprobs` (-1: whole vocabulary) of `logprobs` [B, V], with the sampled
    token prepended: ids [B, k+1] int64, logprobs [B, k+1], and the sampled token's rank
    [B] int64 (1 + number of tokens with a strictly greater logprob)."""
    vocab_size = logprobs.shape[-1]
    k = vocab_size if num_logprobs == -1 else min(num_logprobs, vocab_size)
    topk_logprobs, topk_ids = torch.topk(logprobs, k, dim=-1)
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    return (torch.cat((token_ids, topk_ids), dim=1),
            torch.cat((token_logprobs, topk_logprobs), dim=1), ranks)


# ---------------------------------------------------------------- host -> device helpers
def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        t = t.pin_memory()  # lets the copy overlap instead of blocking the host
    return t.to(device, non_blocking=True)


def _host_indices(rows: list[int], cols: list[int],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    idx = _to_device(torch.tensor([rows, cols], dtype=torch.long), device)
    return idx[0], idx[1]


def _pad_token_lists(token_lists: list[list[int]], num_seqs: int, pad: int,
                     device: torch.device) -> torch.Tensor:
    """Ragged python lists -> [B, L] int64 padded with `pad`, built in one masked write."""
    lengths = torch.tensor([len(t) for t in token_lists] or [0] * num_seqs, dtype=torch.long)
    max_len = int(lengths.max()) if num_seqs else 0  # host tensor: no device sync
    padded = torch.full((num_seqs, max_len), pad, dtype=torch.long)
    if max_len:
        flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
        padded[torch.arange(max_len) < lengths.unsqueeze(1)] = flat
    return _to_device(padded, device)
