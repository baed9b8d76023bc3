"""Sampler vs a plain per-row reference (loops over rows and tokens, same definitions)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Optional

import pytest
import torch

from kvserve.sample.metadata import SamplingMetadata
from kvserve.sample.sampler import (Sampler, apply_allowed_token_ids, apply_bad_words,
                                    apply_logit_bias, apply_min_tokens, apply_penalties,
                                    apply_sampling_transforms, apply_top_k_top_p)
from kvserve.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEG_INF = float("-inf")


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


# ---------------------------------------------------------------- building metadata
def make_metadata(params: list[SamplingParams], vocab_size: int, device: torch.device, *,
                  prompts: Optional[list[list[int]]] = None,
                  outputs: Optional[list[list[int]]] = None,
                  eos_token_id: Optional[int] = None,
                  generators: Optional[dict[int, torch.Generator]] = None) -> SamplingMetadata:
    """What the ModelRunner builds from its persistent batch, from SamplingParams."""
    b = len(params)
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]

    def col(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

    if generators is None:
        generators = {i: torch.Generator(device).manual_seed(p.seed)
                      for i, p in enumerate(params) if p.seed is not None and not p.greedy}
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    max_num_logprobs = None if not wanted else (-1 if -1 in wanted else max(wanted))
    md = SamplingMetadata(
        temperature=col("temperature", torch.float32),
        all_greedy=all(p.greedy for p in params),
        all_random=not any(p.greedy for p in params),
        top_p=col("top_p", torch.float32) if any(p.top_p < 1.0 for p in params) else None,
        top_k=col("top_k", torch.int64) if any(p.top_k > 0 for p in params) else None,
        min_p=col("min_p", torch.float32) if any(p.min_p > 0.0 for p in params) else None,
        generators=generators,
        max_num_logprobs=max_num_logprobs,
    )
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
           for p in params):
        md.presence_penalties = col("presence_penalty", torch.float32)
        md.frequency_penalties = col("frequency_penalty", torch.float32)
        md.repetition_penalties = col("repetition_penalty", torch.float32)
        width = max(len(t) for t in prompts)
        md.prompt_token_ids = torch.tensor([t + [vocab_size] * (width - len(t)) for t in prompts],
                                           dtype=torch.int64, device=device).view(b, width)
        md.output_token_ids = outputs
    if any(p.logit_bias for p in params):
        md.logit_bias = [p.logit_bias for p in params]
    if any(p.allowed_token_ids for p in params):
        mask = torch.zeros(b, vocab_size, dtype=torch.bool)
        for i, p in enumerate(params):
            if p.allowed_token_ids:
                mask[i] = True
                mask[i, p.allowed_token_ids] = False
        md.allowed_token_ids_mask = mask.to(device)
    for i, p in enumerate(params):
        if len(outputs[i]) < p.min_tokens:
            stop = set(p.all_stop_token_ids)
            if eos_token_id is not None and not p.ignore_eos:
                stop.add(eos_token_id)
            md.min_tokens[i] = stop
    return md


# ---------------------------------------------------------------- per-row reference
def ref_process_row(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                    output: list[int], eos_token_id: Optional[int] = None) -> torch.Tensor:
    """Allowed ids, logit bias, min_tokens and penalties for one row, token by token, in
    float32 (penalty values as float32 scalars, like the batched tensors)."""
    x = row.detach().cpu().float().clone()
    if p.allowed_token_ids:
        allowed = set(p.allowed_token_ids)
        for t in range(x.numel()):
            if t not in allowed:
                x[t] = NEG_INF
    for t, bias in (p.logit_bias or {}).items():
        x[t] = x[t] + bias
    if len(output) < p.min_tokens:
        stop = set(p.all_stop_token_ids)
        if eos_token_id is not None and not p.ignore_eos:
            stop.add(eos_token_id)
        for t in stop:
            x[t] = NEG_INF
    rep = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    freq = torch.tensor(p.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(p.presence_penalty, dtype=torch.float32)
    for t, count in Counter(output).items():
        x[t] = x[t] - freq * count
        x[t] = x[t] - pres
    return x


def ref_sampling_row(x: torch.Tensor, p: SamplingParams,
                     margin: float = 1e-4) -> tuple[torch.Tensor, set[int], set[int]]:
    """Temperature, min_p, top_k, top_p for one row. Returns (scaled logits, kept ids,
    ids too close to a top_p/min_p boundary for float rounding to settle)."""
    x = (x.detach().cpu().float() / p.temperature).double()
    vocab = x.numel()
    kept = {t for t in range(vocab) if math.isfinite(x[t])}
    unsure: set[int] = set()
    if p.min_p > 0:
        probs = torch.softmax(x, dim=0)
        thresh = p.min_p * probs.max().item()
        for t in list(kept):
            if abs(probs[t].item() - thresh) < margin * thresh:
                unsure.add(t)
            if probs[t].item() < thresh:
                kept.discard(t)
    if p.top_k > 0 and p.top_k < len(kept):
        kth = sorted((x[t].item() for t in kept), reverse=True)[p.top_k - 1]
        kept = {t for t in kept if x[t].item() >= kth}
    if p.top_p < 1.0:
        masked = torch.full_like(x, NEG_INF)
        for t in kept:
            masked[t] = x[t]
        probs = torch.softmax(masked, dim=0)
        order = sorted(kept, key=lambda t: -x[t].item())
        above = 0.0  # probability mass of the tokens strictly above
        new_kept = set()
        for rank, t in enumerate(order):
            if rank == 0 or above < p.top_p:
                new_kept.add(t)
            if rank > 0 and abs(above - p.top_p) < margin:
                unsure.add(t)
            above += probs[t].item()
        kept = new_kept
    return x.float(), kept, unsure


def kept_set(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row.cpu()).nonzero().flatten().tolist())


# ---------------------------------------------------------------- tests
def test_greedy_equals_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=device) * 3
    md = make_metadata([SamplingParams(temperature=0.0)] * 6, 50, device)
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.logprob_token_ids is None
    # bf16 logits go through float32.
    out = Sampler()(logits.bfloat16(), md)
    assert torch.equal(out.sampled_token_ids, logits.bfloat16().float().argmax(dim=-1))


def test_mixed_batch_greedy_rows_and_random_rows(device):
    torch.manual_seed(1)
    vocab = 64
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_p=0.3)]
    logits = torch.randn(len(params), vocab, device=device) * 2
    md = make_metadata(params, vocab, device)
    assert not md.all_greedy and not md.all_random
    for _ in range(20):
        tokens = Sampler()(logits, md).sampled_token_ids.cpu()
        for i, p in enumerate(params):
            if p.greedy:
                assert tokens[i] == logits[i].argmax().item()
            else:
                _, kept, _ = ref_sampling_row(logits[i], p)
                assert tokens[i].item() in kept


ROW_PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=7, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=2.0, top_k=1000),       # k over the vocabulary: off
    SamplingParams(temperature=0.8, top_p=0.95, min_p=0.1),
]


def test_sampling_masks_match_reference(device):
    torch.manual_seed(2)
    vocab = 200
    logits = torch.randn(len(ROW_PARAMS), vocab, device=device) * 3
    md = make_metadata(ROW_PARAMS, vocab, device)
    processed = apply_sampling_transforms(logits.clone(), md).cpu()
    for i, p in enumerate(ROW_PARAMS):
        scaled, kept, unsure = ref_sampling_row(logits[i], p)
        got = kept_set(processed[i])
        assert got - unsure == kept - unsure, f"row {i} ({p})"
        idx = sorted(got)
        torch.testing.assert_close(processed[i, idx], scaled[idx])
    # Sampled tokens never leave the kept set: every row tiled 100 times, one batch.
    reps = 100
    tiled = make_metadata([p for p in ROW_PARAMS for _ in range(reps)], vocab, device)
    tokens = Sampler()(logits.repeat_interleave(reps, dim=0), tiled).sampled_token_ids.cpu()
    for i in range(len(ROW_PARAMS)):
        assert set(tokens[i * reps:(i + 1) * reps].tolist()) <= kept_set(processed[i])


def test_top_k_top_p_off_skips_the_sort(device, monkeypatch):
    logits = torch.randn(3, 30, device=device)
    assert apply_top_k_top_p(logits, None, None) is logits

    def no_sort(*args, **kwargs):
        raise AssertionError("sorted although top_k and top_p are off")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    md = make_metadata([SamplingParams(temperature=0.8, min_p=0.1)] * 3, 30, device)
    assert md.top_k is None and md.top_p is None
    Sampler()(logits, md)


def _seeded_run(logits: torch.Tensor, params: list[SamplingParams], seeded_row: int,
                steps: int, device: torch.device) -> list[int]:
    vocab = logits.shape[1]
    generators = {i: torch.Generator(device).manual_seed(p.seed)
                  for i, p in enumerate(params) if p.seed is not None}
    md = make_metadata(params, vocab, device, generators=generators)
    return [Sampler()(logits, md).sampled_token_ids[seeded_row].item() for _ in range(steps)]


def test_seeded_rows_do_not_depend_on_the_batch(device):
    vocab = 1000
    g = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=g) * 0.5  # flat enough that tokens vary step to step
    others = torch.randn(6, vocab, generator=g)
    me = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    torch.manual_seed(10)
    batch_a = torch.stack([row, others[0], others[1]]).to(device)
    a = _seeded_run(batch_a, [me, SamplingParams(), SamplingParams(temperature=0.0)],
                    0, 8, device)
    torch.manual_seed(99)  # different global noise for the unseeded rows
    batch_b = torch.stack([others[2], others[3], others[4], row, others[5]]).to(device)
    b = _seeded_run(batch_b,
                    [SamplingParams(top_k=5), SamplingParams(seed=7), SamplingParams(min_p=0.1),
                     me, SamplingParams(temperature=0.0)],
                    3, 8, device)
    # Every row seeded (no batched draw at all).
    c = _seeded_run(torch.stack([others[0], row]).to(device),
                    [SamplingParams(seed=5), me], 1, 8, device)
    assert a == b == c
    assert len(set(a)) > 1
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert _seeded_run(batch_a, [other_seed, SamplingParams(), SamplingParams()],
                       0, 8, device) != a


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = probs > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_top_p_distribution_matches_reference(device, seeded):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0, -2.0])
    p = SamplingParams(temperature=0.8, top_p=0.8)
    scaled, kept, unsure = ref_sampling_row(logits, p)
    assert not unsure and 2 < len(kept) < len(logits)
    masked = torch.full_like(scaled, NEG_INF)
    masked[sorted(kept)] = scaled[sorted(kept)]
    ref_probs = torch.softmax(masked.double(), dim=0)

    n = 4000 if not seeded else 2000
    torch.manual_seed(0)
    gens = {i: torch.Generator(device).manual_seed(i) for i in range(n)} if seeded else {}
    md = make_metadata([p] * n, len(logits), device, generators=gens)
    tokens = Sampler()(logits.to(device).expand(n, -1), md).sampled_token_ids.cpu()
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    assert counts[ref_probs == 0].sum() == 0
    df = len(kept) - 1
    # ~5 standard deviations above the chi-square mean: fails for a wrong distribution
    # (no temperature, or no top_p renormalisation, gives hundreds at these draw counts).
    assert _chi_square(counts, ref_probs) < df + 5 * math.sqrt(2 * df)


def test_penalties_match_reference_exactly(device):
    torch.manual_seed(4)
    vocab = 40
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(temperature=0.0),   # defaults: untouched
        SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-1.1,
                       presence_penalty=1.9),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
    ]
    prompts = [[1, 2, 3, 3], [5], [0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], []]
    outputs = [[4, 4, 9], [5, 5, 5, 6, 12], [1], [], [2, 2, 2, 39, 0]]
    logits = torch.randn(len(params), vocab, device=device) * 3
    # Make the penalties move the greedy pick in rows 1 and 4.
    logits[1, 5] = logits[1].max() + 1.0    # -(0.7 * 3) + 0.4 takes it below the runner-up
    logits[4, 2] = logits[4].max() + 0.3    # presence 0.5 takes it below
    md = make_metadata(params, vocab, device, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits.clone(), md).cpu()
    ref = torch.stack([ref_process_row(logits[i], params[i], prompts[i], outputs[i])
                       for i in range(len(params))])
    assert torch.equal(got, ref)
    assert not torch.equal(got[[0, 1, 3, 4]], logits.cpu()[[0, 1, 3, 4]])
    assert torch.equal(got[2], logits[2].cpu())
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids.cpu(), ref.argmax(dim=-1))
    assert out.sampled_token_ids[1].item() != 5 and out.sampled_token_ids[4].item() != 2


def test_logit_bias_and_allowed_token_ids(device):
    torch.manual_seed(5)
    vocab = 30
    params = [
        SamplingParams(temperature=0.0, logit_bias={7: 100.0, 3: -2.5}),
        SamplingParams(temperature=0.0, allowed_token_ids=[4, 11, 20]),
        SamplingParams(temperature=0.0, allowed_token_ids=[4, 11], logit_bias={11: 50.0}),
        SamplingParams(temperature=0.0),
    ]
    logits = torch.randn(len(params), vocab, device=device)
    md = make_metadata(params, vocab, device)
    got = apply_logit_bias(apply_allowed_token_ids(logits, md.allowed_token_ids_mask),
                           md.logit_bias).cpu()
    ref = torch.stack([ref_process_row(logits[i], params[i], [], [])
                       for i in range(len(params))])
    assert torch.equal(got, ref)
    tokens = Sampler()(logits, md).sampled_token_ids.cpu().tolist()
    allowed = logits[1].cpu().clone()
    allowed[[t for t in range(vocab) if t not in (4, 11, 20)]] = NEG_INF
    assert tokens == [7, allowed.argmax().item(), 11, logits[3].argmax().item()]
    # Random rows only ever sample allowed ids.
    rows = 300
    rand = make_metadata([SamplingParams(temperature=1.5, allowed_token_ids=[1, 2, 3])] * rows,
                         vocab, device)
    drawn = Sampler()(logits[3].expand(rows, -1), rand).sampled_token_ids.cpu()
    assert set(drawn.tolist()) == {1, 2, 3}


def test_bad_words_forbid_the_completing_token(device):
    logits = torch.zeros(4, 10, device=device)
    words = [[3], [5, 6, 7], [8, 9]]
    got = apply_bad_words(logits, {
        0: (words, []),              # only the one-token word applies with no output yet
        1: (words, [1, 5, 6]),       # ... 5 6 -> 7 would complete [5, 6, 7]
        2: (words, [5, 4, 8]),       # ... 8 -> 9 would complete [8, 9]; [5, 6, 7] does not apply
        # row 3 has no bad words
    }).cpu()
    forbidden = {(r, c) for r, c in zip(*torch.nonzero(got == NEG_INF, as_tuple=True))}
    assert {(int(r), int(c)) for r, c in forbidden} == {(0, 3), (1, 3), (1, 7), (2, 3), (2, 9)}
    assert torch.equal(apply_bad_words(logits, {}), logits)


def test_min_tokens_forbids_stop_ids(device):
    torch.manual_seed(6)
    vocab = 25
    logits = torch.randn(vocab, device=device)
    top2 = logits.topk(2).indices.tolist()
    eos = top2[1]
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[top2[0]]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[top2[0]]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[top2[0]],
                             ignore_eos=True)]
    outputs = [[1], [1, 2, 3], [1]]   # row 1 has reached min_tokens
    md = make_metadata(params, vocab, device, outputs=outputs, eos_token_id=eos)
    assert md.min_tokens == {0: {top2[0], eos}, 2: {top2[0]}}
    batch = logits.expand(3, -1)
    got = apply_min_tokens(batch, md.min_tokens).cpu()
    for i in range(3):
        assert torch.equal(got[i], ref_process_row(logits, params[i], [], outputs[i], eos))
    third = logits.topk(3).indices[2].item()
    assert Sampler()(batch, md).sampled_token_ids.tolist() == [third, top2[0], eos]
    # Random rows under min_tokens never draw a stop id, even at high temperature.
    rows = 400
    rand = make_metadata([SamplingParams(temperature=3.0, min_tokens=2,
                                         stop_token_ids=[top2[0]])] * rows,
                         vocab, device, outputs=[[]] * rows, eos_token_id=eos)
    drawn = Sampler()(logits.expand(rows, -1), rand).sampled_token_ids.cpu()
    assert not set(drawn.tolist()) & {top2[0], eos}


def _ref_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int):
    ids, values, ranks = [], [], []
    for i in range(logits.shape[0]):
        lp = torch.log_softmax(logits[i].cpu().float(), dim=0)
        order = sorted(range(lp.numel()), key=lambda t: -lp[t].item())
        top = order if k == -1 else order[:k]
        s = sampled[i].item()
        ids.append([s] + top)
        values.append([lp[s].item()] + [lp[t].item() for t in top])
        ranks.append(sum(1 for t in range(lp.numel()) if lp[t] > lp[s]) + 1)
    return torch.tensor(ids), torch.tensor(values), torch.tensor(ranks)


@pytest.mark.parametrize("k", [0, 3, -1])
def test_logprobs_raw_topk_sampled_first(device, k):
    torch.manual_seed(7)
    vocab = 50
    params = [SamplingParams(temperature=0.0, logprobs=k, repetition_penalty=1.5,
                             logit_bias={5: 8.0}),
              SamplingParams(temperature=0.6, top_p=0.9, logprobs=k, seed=3),
              SamplingParams(temperature=2.0, logprobs=k, presence_penalty=1.0),
              SamplingParams(temperature=0.0)]
    logits = torch.randn(len(params), vocab, device=device) * 2
    md = make_metadata(params, vocab, device, prompts=[[5, 6], [1], [], [2]],
                       outputs=[[6], [], [3, 3], []])
    assert md.max_num_logprobs == k
    out = Sampler()(logits, md)
    sampled = out.sampled_token_ids.cpu()
    ids, values, ranks = _ref_logprobs(logits, sampled, k)
    width = vocab + 1 if k == -1 else k + 1
    assert out.logprob_token_ids.shape == out.logprobs.shape == (len(params), width)
    assert torch.equal(out.logprob_token_ids[:, 0].cpu(), sampled)
    assert torch.equal(out.logprob_token_ids.cpu(), ids)
    torch.testing.assert_close(out.logprobs.cpu(), values)   # raw: no penalty, bias, temp
    assert torch.equal(out.sampled_token_ranks.cpu(), ranks)
    assert sampled[0].item() == 5 and ranks[0].item() > 1  # bias moved the pick, not logprobs
    if k == -1:
        assert sorted(out.logprob_token_ids[:, 1:].cpu()[0].tolist()) == list(range(vocab))


def test_sampled_rank_counts_strictly_greater(device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]], device=device)
    md = make_metadata([SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[2])],
                       4, device)
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [2]
    assert out.sampled_token_ranks.tolist() == [1]  # tied with token 1: nothing above it
    md = make_metadata([SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[0])],
                       4, device)
    assert Sampler()(logits, md).sampled_token_ranks.tolist() == [3]


def test_caller_logits_not_modified(device):
    torch.manual_seed(8)
    vocab = 40
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9, min_p=0.05,
                             repetition_penalty=1.2, logit_bias={1: 3.0},
                             allowed_token_ids=list(range(30)), min_tokens=2,
                             stop_token_ids=[0]),
              SamplingParams(temperature=0.0, frequency_penalty=0.5)]
    logits = torch.randn(2, vocab, device=device)
    before = logits.clone()
    md = make_metadata(params, vocab, device, prompts=[[1, 2], [3]], outputs=[[4], [5]])
    Sampler()(logits, md)
    assert torch.equal(logits, before)


def test_cpu_argmax_is_torch_argmax() -> None:
    """The sampler's CPU argmax (numpy) picks what torch's does: the first maximum, NaN
    counting as the maximum, on strided rows too."""
    from kvserve.sample.sampler import argmax
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 300), generator=g).to(torch.float32)   # many ties
    x[3, 7] = x[3, 200] = float("nan")
    x[4] = float("-inf")
    x[5, :] = 1.0
    x[6, 10] = x[6, 20] = float("inf")
    for t in (x, x.double(), x[:, 5:250], x.t().contiguous().t()[:, ::2]):
        got = argmax(t)
        assert got.dtype == torch.int64
        assert torch.equal(got, t.argmax(dim=-1))
