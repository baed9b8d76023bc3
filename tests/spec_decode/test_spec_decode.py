"""Speculative decoding end to end (n-gram proposer): outputs are what they would be without
it — identical greedy tokens under every scheduling feature, the same sampling distribution —
the acceptance metrics add up, and every KV block is freed."""
from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from kvserve import LLM, SamplingParams
from kvserve.metrics.loggers import LoggingStatLogger
from kvserve.metrics.prometheus import PrometheusStatLogger
from kvserve.sampling_params import StructuredOutputsParams as SO
from tests.structured_output.conftest import REGEX
from tests.spec_decode.conftest import BASE, GREEDY, prompts
from tests.utils import assert_same_outputs

# Adaptive rule off (batch size and acceptance EMA): every request drafts whenever it can.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "disable_by_batch_size": None, "min_acceptance_rate": 0.0}


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def assert_spec_metrics_add_up(llm: LLM, min_accepted: int = 1) -> dict:
    spec = llm.get_stats()["spec_decoding"]
    per_pos = spec["num_accepted_tokens_per_pos"]
    assert 0 < spec["num_drafts"] <= spec["num_draft_tokens"]
    assert min_accepted <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert sum(per_pos) == spec["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert per_pos[0] <= spec["num_drafts"]
    return spec


def check_metric_exports(stats: dict, spec: dict) -> None:
    """The engine's counters, exported as vLLM names them: Prometheus and the log line."""
    prom = PrometheusStatLogger("m")
    prom.update_scheduler_stats(stats)
    prom.update_scheduler_stats(stats)          # a repeated report counts nothing twice
    text = prom.render()[0].decode()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        line = f'kvserve:spec_decode_{key}_total{{engine="0",model_name="m"}} {float(spec[key])}'
        assert line in text, (line, text)
    for pos, count in enumerate(spec["num_accepted_tokens_per_pos"]):
        line = (f'kvserve:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                f'model_name="m",position="{pos}"}} {float(count)}')
        assert line in text, line
    message = LoggingStatLogger(log_interval=1.0)
    message.record(stats, None)
    out = message.log()
    mean = 1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    assert f"SpecDecoding metrics: Mean acceptance length: {mean:.2f}" in out, out
    assert "Per-position acceptance rate: " in out


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_num_batched_tokens=24, enable_prefix_caching=False),   # chunked prefill, tight budget
    dict(num_gpu_blocks_override=32, scheduling_policy="priority"),  # preemption
], ids=["plain", "chunked", "preempt"])
def test_greedy_identical(tiny_llama: str, baseline: list, kw: dict) -> None:
    llm = LLM(tiny_llama, **BASE, **kw, speculative_config=NGRAM)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(baseline, outs, f"ngram {kw}")
    spec = assert_spec_metrics_add_up(llm, min_accepted=20)
    if not kw:
        check_metric_exports(llm.get_stats(), spec)
    if "num_gpu_blocks_override" in kw:
        assert llm.get_stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_greedy_identical_with_prefix_cache_hits(tiny_llama: str, baseline: list) -> None:
    llm = LLM(tiny_llama, **BASE, enable_prefix_caching=True, speculative_config=NGRAM,
              block_size=4)
    first = llm.generate(prompts(), GREEDY, use_tqdm=False)
    second = llm.generate(prompts(), GREEDY, use_tqdm=False)   # prompts and outputs cached now
    assert llm.get_stats()["prefix_cache_hits"] > 0
    assert_same_outputs(baseline, first, "ngram + prefix caching (cold)")
    assert_same_outputs(baseline, second, "ngram + prefix caching (warm)")
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_stops_logprobs_and_n_mid_acceptance(tiny_llama: str, baseline: list) -> None:
    """max_tokens, stop token ids and stop strings landing inside an accepted run; logprobs of
    every accepted token; grammar-constrained requests beside drafting ones; n > 1 with seeds."""
    plain = LLM(tiny_llama, **BASE)
    spec = LLM(tiny_llama, **BASE, speculative_config=NGRAM)
    ps = prompts()
    # A stop token / string taken from each baseline output at position 7.
    stop_ids = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop_token_ids=[o.outputs[0].token_ids[7]]) for o in baseline]
    stop_str = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop=[o.outputs[0].text[-6:]]) if o.outputs[0].text[-6:].strip()
                else GREEDY for o in baseline]
    odd_len = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, n=2, seed=7)
    for params in (stop_ids, stop_str, odd_len):
        a = plain.generate(ps, params, use_tqdm=False)
        b = spec.generate(ps, params, use_tqdm=False)
        assert_same_outputs(a, b, "stops")
        if params is odd_len:
            for x, y in zip(a, b):
                assert len(y.outputs[0].token_ids) == 13
                for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                    assert lx.keys() == ly.keys()
                    for t in lx:
                        assert abs(lx[t].logprob - ly[t].logprob) < 1e-4
                        assert lx[t].rank == ly[t].rank
    # Grammar-constrained requests run without drafts (the others in the batch draft).
    constrained = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                  structured_outputs=SO(regex=REGEX)) if i % 2 else GREEDY
                   for i in range(len(ps))]
    a = plain.generate(ps, constrained, use_tqdm=False)
    b = spec.generate(ps, constrained, use_tqdm=False)
    assert_same_outputs(a, b, "structured outputs")
    for out, params in zip(b, constrained):
        if params.structured_outputs is not None and out.outputs[0].finish_reason == "stop":
            assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
    # Seeded sampling with drafts is reproducible, whatever else is in the batch.
    one = spec.generate(ps[-1:], seeded, use_tqdm=False)[0]
    many = spec.generate(ps, seeded, use_tqdm=False)[-1]
    assert [c.token_ids for c in one.outputs] == [c.token_ids for c in many.outputs]
    assert all(len(c.token_ids) == 12 for c in many.outputs)
    assert_spec_metrics_add_up(spec)
    assert_all_blocks_free(spec)
    plain.shutdown()
    spec.shutdown()


def _two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's two-sample statistic for equal sample sizes; categories seen fewer than 10
    times in both samples together are pooled."""
    keys = set(a) | set(b)
    small = [k for k in keys if a[k] + b[k] < 10]
    cells = [(a[k], b[k]) for k in keys if a[k] + b[k] >= 10]
    pooled = (sum(a[k] for k in small), sum(b[k] for k in small))
    if sum(pooled) > 0:
        cells.append(pooled)
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return stat, len(cells) - 1


def _sample_tokens(llm: LLM, prompt: list[int], n: int) -> list[tuple[int, ...]]:
    params = [SamplingParams(temperature=1.0, top_k=50, min_p=0.01, max_tokens=4,
                             ignore_eos=True, seed=1000 + i) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]


def test_sampling_distribution_unchanged(peaked_llama: str) -> None:
    """2nd and 3rd output tokens, with and without speculation: same distribution. The LM
    head is scaled so the target's distributions are peaked (an always-accept bug fails this)."""
    n = 500
    plain = LLM(peaked_llama, **BASE)
    # The prompt is the model's own sampled text: whatever it samples next has likely occurred
    # in it, so the n-gram proposer (min 1) drafts from the 2nd output token on, drafting
    # what followed that token before: rejected mostly, accepted sometimes.
    seed_prompt = [17, 230, 411, 95, 6, 800]
    text = plain.generate([{"prompt_token_ids": seed_prompt}],
                          SamplingParams(temperature=1.0, max_tokens=300, ignore_eos=True, seed=5),
                          use_tqdm=False)[0].outputs[0].token_ids
    prompt = seed_prompt + list(text)
    ref = _sample_tokens(plain, prompt, n)
    plain.shutdown()
    spec = LLM(peaked_llama, **BASE, speculative_config={**NGRAM, "prompt_lookup_min": 1})
    got = _sample_tokens(spec, prompt, n)
    stats = assert_spec_metrics_add_up(spec)
    spec.shutdown()
    for pos in (1, 2):
        stat, df = _two_sample_chi_square(Counter(t[pos] for t in ref),
                                          Counter(t[pos] for t in got))
        assert df >= 3, "the test model's distribution is too peaked to test anything"
        # ~5 standard deviations above the chi-square mean.
        assert stat < df + 5 * math.sqrt(2 * df), (pos, stat, df)
    # Checked after the distributions, so that a wrong acceptance rule fails on them.
    assert stats["num_drafts"] >= n // 4, stats          # many requests drafted
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]   # and some were rejected


def test_fewer_draft_tokens_reach_the_proposer(tiny_llama: str, baseline: list,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule's k' (SchedulerOutput.spec_decode_num_draft_tokens) caps every proposal:
    pinned to 2 of num_speculative_tokens = 4, no request drafts more than 2 tokens, the
    later positions are never accepted, and greedy outputs are unchanged. In process, so that
    the pin reaches the engine core's scheduler."""
    from kvserve.spec_decode.adaptive import SpecDecodeController
    monkeypatch.setenv("KVSERVE_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setattr(SpecDecodeController, "num_draft_tokens", lambda self, b, d: 2)
    llm = LLM(tiny_llama, **BASE, speculative_config=NGRAM)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(baseline, outs, "ngram, k' = 2")
    spec = assert_spec_metrics_add_up(llm, min_accepted=20)
    assert spec["num_draft_tokens"] <= 2 * spec["num_drafts"], spec
    assert spec["num_accepted_tokens_per_pos"][2:] == [0, 0], spec
    assert_all_blocks_free(llm)
    llm.shutdown()
