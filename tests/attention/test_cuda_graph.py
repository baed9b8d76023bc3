"""CUDA graphs and GPU memory sizing: the device-independent rules on CPU, the rest on CUDA
(skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from kvserve.worker.cuda_graph import capture_sizes, padded_batch_size
from kvserve.worker.gpu_memory import (MemoryProfile, check_kv_cache_fits, graphs_memory,
                                       kv_cache_budget)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GiB = 1 << 30


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(256)[:7] == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(256)[-1] == 256 and capture_sizes(512)[-1] == 512
    assert capture_sizes(600)[-3:] == [480, 496, 512]
    assert capture_sizes(20) == [1, 2, 4, 8, 16]
    sizes = capture_sizes(40)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 40)] == \
        [1, 2, 4, 8, 8, 16, 24, 40]
    assert padded_batch_size(41, sizes) is None          # above the largest: eager


def test_kv_cache_budget_arithmetic() -> None:
    p = MemoryProfile(total=80 * GiB, free=70 * GiB, weights=2 * GiB,
                      peak_activations=3 * GiB, non_torch=1 * GiB)
    assert kv_cache_budget(p, 0.9) == 72 * GiB - 6 * GiB
    assert kv_cache_budget(p, 0.5) == 40 * GiB - 6 * GiB
    # Never more than is free (another process holds memory).
    assert kv_cache_budget(MemoryProfile(80 * GiB, 10 * GiB, 2 * GiB, 3 * GiB, 1 * GiB),
                           0.9) == 10 * GiB
    assert check_kv_cache_fits(10 * GiB, GiB // 4, 8, 4096, p, 0.9) == 40
    # The decode graphs, captured after the cache, are set aside first.
    g = MemoryProfile(total=80 * GiB, free=70 * GiB, weights=2 * GiB, peak_activations=3 * GiB,
                      non_torch=1 * GiB, cuda_graphs=GiB // 2)
    assert kv_cache_budget(g, 0.9) == 72 * GiB - 6 * GiB - GiB // 2


def test_graphs_memory_from_two_captures() -> None:
    MiB = 1 << 20
    # The largest bucket's pool, then one increment for each of the other buckets.
    assert graphs_memory(300 * MiB, 2 * MiB, 35) == 300 * MiB + 34 * 2 * MiB
    assert graphs_memory(300 * MiB, 2 * MiB, 1) == 300 * MiB
    assert graphs_memory(300 * MiB, 2 * MiB, 0) == 0
    # A capture measured as freeing memory (the driver's own reuse) counts as nothing.
    assert graphs_memory(-MiB, -MiB, 4) == 0


def test_kv_cache_too_small_names_the_numbers() -> None:
    p = MemoryProfile(total=16 * GiB, free=12 * GiB, weights=13 * GiB,
                      peak_activations=GiB, non_torch=GiB // 2)
    budget = kv_cache_budget(p, 0.9)
    with pytest.raises(ValueError, match=r"max_model_len=8192 needs 1\.00 GiB \(512 blocks\), "
                                         r"but only 0\.00 GiB is left: gpu_memory_utilization="
                                         r"0\.9 of 16\.00 GiB.*weights 13\.00 GiB"):
        check_kv_cache_fits(budget, 2 << 20, 512, 8192, p, 0.9)
    # Room for some blocks, but fewer than one max_model_len request needs.
    with pytest.raises(ValueError, match=r"needs 1\.00 GiB \(512 blocks\), but only 0\.50 GiB"):
        check_kv_cache_fits(GiB // 2, 2 << 20, 512, 8192, p, 0.9)
    assert check_kv_cache_fits(GiB, 2 << 20, 512, 8192, p, 0.9) == 512


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(tiny_llama: str, dtype: str) -> None:
    from kvserve import LLM, SamplingParams
    from tests.utils import random_prompts

    prompts = [{"prompt_token_ids": p} for p in random_prompts(11, 5, 40, vocab=1024, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    kw = dict(dtype=dtype, max_model_len=256, max_num_seqs=16, multiprocessing=False,
              device="cuda", attention_backend="TRITON_ATTN")
    eager = LLM(tiny_llama, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, enforce_eager=False, **kw)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner
    assert runner.cuda_graphs is not None and sorted(runner.cuda_graphs.graphs) == [1, 2, 4, 8, 16]
    graphed = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(graphed, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in la:
                assert abs(la[t].logprob - lb[t].logprob) < 2e-2


def test_kv_cache_too_small_names_the_graphs() -> None:
    p = MemoryProfile(total=16 * GiB, free=12 * GiB, weights=13 * GiB, peak_activations=GiB,
                      non_torch=GiB // 2, cuda_graphs=GiB // 4)
    with pytest.raises(ValueError, match=r"non-torch memory 0\.50 GiB and CUDA graphs 0\.25 GiB"
                                         r".*or enforce_eager"):
        check_kv_cache_fits(kv_cache_budget(p, 0.9), 2 << 20, 512, 8192, p, 0.9)


@needs_cuda
@pytest.mark.parametrize("lora", [False, True])
def test_graph_memory_set_aside_covers_the_capture(tiny_llama: str, lora: bool) -> None:
    """The profile run's estimate of the decode graphs' memory (taken off the KV cache's
    budget) against what capturing them took after the cache was allocated."""
    from kvserve import LLM
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8) if lora else {}
    llm = LLM(tiny_llama, dtype="bfloat16", max_model_len=256, max_num_seqs=64, device="cuda",
              multiprocessing=False, attention_backend="TRITON_ATTN", **kw)
    worker = llm.llm_engine.engine_core.engine_core.model_executor.worker
    graphs = worker.model_runner.cuda_graphs
    assert graphs is not None and len(graphs.graphs) == 10
    assert len(graphs.plain_graphs) == (10 if lora else 0)
    took = graphs.memory_bytes + graphs.static_bytes()
    estimate = worker.memory_profile.cuda_graphs
    assert took > 0 and estimate >= 0.95 * took, (estimate, took)
    assert estimate <= 3 * took + (256 << 20), (estimate, took)
    # The profile's budget is what the cache got: the graphs were not left in it.
    eager = LLM(tiny_llama, dtype="bfloat16", max_model_len=256, max_num_seqs=64, device="cuda",
                multiprocessing=False, attention_backend="TRITON_ATTN", enforce_eager=True,
                **kw)
    assert eager.llm_engine.engine_core.engine_core.model_executor.worker.memory_profile \
        .cuda_graphs == 0


@needs_cuda
def test_gpu_memory_utilization_too_low_fails_at_start(tiny_llama: str) -> None:
    from kvserve import LLM
    with pytest.raises(ValueError, match="KV cache too small: one request of max_model_len"):
        LLM(tiny_llama, gpu_memory_utilization=0.001, device="cuda", multiprocessing=False,
            max_model_len=512)


@needs_cuda
def test_batch1_graphs_match_transformers(tiny_llama: str) -> None:
    """One request at a time on CUDA with graphs: the batch-1 decode kernels (the SiLU-and-mul
    + down-projection GEMV, split-KV attention merged by its last split) against HF float32,
    with the kernels' launches checked in a profile."""
    from kvserve import LLM, SamplingParams
    from tests.utils import check_greedy_close, hf_greedy, random_prompts

    prompts = random_prompts(3, 20, 60, vocab=1024, seed=5)
    refs = hf_greedy(tiny_llama, prompts, 16)
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, max_num_seqs=4,
              multiprocessing=False, device="cuda", attention_backend="TRITON_ATTN")
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    outs = []
    with torch.profiler.profile(activities=acts) as prof:
        for p in prompts:
            outs += llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    names = {e.name for e in prof.events()}
    assert "_silu_and_mul_linear_kernel" in names and "_merge_splits_kernel" not in names
    matched = sum(check_greedy_close(t, lp, o, name=f"prompt {i}")
                  for i, ((t, lp), o) in enumerate(zip(refs, outs)))
    assert matched >= 0.8 * 3 * 16
