"""Outputs must not depend on scheduling: each feature against a plain run of kvserve."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.utils import assert_same_outputs, random_prompts

BASE = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def shared_prefix_prompts(n: int = 24, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefixes = random_prompts(3, 40, 70, vocab=1024, seed=seed + 100)
    return [{"prompt_token_ids": prefixes[i % 3] + [rng.randrange(5, 1024) for _ in range(rng.randint(1, 30))]}
            for i in range(n)]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.fixture(scope="module")
def baseline(tiny_llama: str) -> list:
    llm = LLM(tiny_llama, **BASE, enable_prefix_caching=False, enable_chunked_prefill=False)
    outs = llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)
    assert_all_blocks_free(llm)
    return outs


def test_prefix_caching_same_outputs_and_hits(tiny_llama: str, baseline: list) -> None:
    llm = LLM(tiny_llama, **BASE, enable_prefix_caching=True)
    first = llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)
    second = llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)  # all prefixes cached now
    stats = llm.get_stats()
    assert stats["prefix_cache_hits"] > 0, stats
    # Every prompt of the second round hits at least its shared prefix's full blocks.
    assert stats["prefix_cache_hits"] >= 24 * 32, stats
    assert_same_outputs(baseline, first, "prefix caching (cold)")
    assert_same_outputs(baseline, second, "prefix caching (warm)")
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=24),
                                dict(long_prefill_token_threshold=7)])
def test_chunked_prefill_same_outputs(tiny_llama: str, baseline: list, kw: dict) -> None:
    llm = LLM(tiny_llama, **BASE, enable_prefix_caching=False, **kw)
    outs = llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(baseline, outs, f"chunked prefill {kw}")
    assert_all_blocks_free(llm)


def test_preemption_same_outputs(tiny_llama: str, baseline: list) -> None:
    # 40 blocks of 16 tokens for 24 requests of up to ~116 tokens: they cannot all fit.
    llm = LLM(tiny_llama, **BASE, num_gpu_blocks_override=40)
    outs = llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0, stats
    assert_same_outputs(baseline, outs, "preemption")
    assert_all_blocks_free(llm)


def test_priority_policy(tiny_llama: str, baseline: list) -> None:
    # In-process engine: every request is queued before the first step. (With the engine core
    # in its own process, stepping starts as soon as the first request arrives.)
    llm = LLM(tiny_llama, **BASE, scheduling_policy="priority", max_num_seqs=4, multiprocessing=False)
    n = len(baseline)
    priorities = [(n - i) for i in range(n)]   # later prompts are more urgent
    outs = llm.generate(shared_prefix_prompts(), GREEDY, use_tqdm=False, priority=priorities)
    assert_same_outputs(baseline, outs, "priority scheduling")
    # With 4 slots, the most urgent request is admitted before the least urgent one finishes.
    first_token = [o.metrics.first_token_time for o in outs]
    assert first_token[-1] < first_token[0]
    # The 4 most urgent run first: all of them see a token before any of the 4 least urgent.
    assert max(first_token[-4:]) < min(first_token[:4])
    # first_scheduled_time comes from the engine core's SCHEDULED event: after arrival, before
    # the first token, and in priority order for the first and last four.
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time, m
    scheduled = [o.metrics.first_scheduled_time for o in outs]
    assert max(scheduled[-4:]) < min(scheduled[:4])
    assert_all_blocks_free(llm)


def test_batch_of_one_equals_batch_of_32(tiny_llama: str) -> None:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(32, 2, 90, vocab=1024, seed=7)]
    llm = LLM(tiny_llama, **BASE)
    batched = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    single = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts[:8]]
    assert_same_outputs(batched[:8], single, "batch 1 vs 32")
    assert_all_blocks_free(llm)
