"""CUDA graphs and GPU memory sizing: the device-independent rules on CPU, the rest on CUDA
(skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from kvserve.config import CompilationConfig
from kvserve.worker.cuda_graph import CUDAGraphRunner, padded_batch_size
from tests.utils import EmulatedGraphs
from kvserve.worker.gpu_memory import (MemoryProfile, check_kv_cache_fits, graphs_memory,
                                       kv_cache_budget)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
GiB = 1 << 30


def _assert_close(got: list, want: list, tol: float) -> None:
    """The same tokens, and each position's top logprobs within tol."""
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for t in lb:
                assert abs(la[t].logprob - lb[t].logprob) < tol


def test_capture_sizes_and_buckets() -> None:
    def buckets(mode: str = "FULL_DECODE_ONLY", seqs: int = 256, tokens: int = 8192, **kw):
        return CompilationConfig(cudagraph_mode=mode, **kw).graph_buckets(seqs, tokens)

    decode, mixed = buckets()                 # the default: all-decode steps only
    assert decode[:7] == [1, 2, 4, 8, 16, 24, 32] and decode[-1] == 256 and mixed == []
    assert buckets(seqs=512)[0][-1] == 512 and buckets(seqs=600)[0][-3:] == [480, 496, 512]
    assert buckets(seqs=20)[0] == [1, 2, 4, 8, 16]
    sizes = buckets(seqs=40)[0]
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 40)] == \
        [1, 2, 4, 8, 8, 16, 24, 40]
    assert padded_batch_size(41, sizes) is None          # above the largest: eager
    # FULL: mixed steps by tokens, up to vLLM's min(2 x max_num_seqs, 512) and the step budget.
    decode, mixed = buckets("FULL", seqs=40)
    assert decode[-1] == 40 and mixed[-1] == 80
    assert buckets("FULL", seqs=256, tokens=128)[1][-1] == 128
    assert buckets("FULL", max_cudagraph_capture_size=16)[1] == [1, 2, 4, 8, 16]
    assert buckets("FULL", seqs=4, cudagraph_capture_sizes=[8, 2, 32]) == ([2], [2, 8, 32])
    assert buckets("none") == ([], [])
    # Sizes all above the limits: nothing to capture (the runner then captures no graph).
    assert buckets(seqs=4, cudagraph_capture_sizes=[8, 16]) == ([], [])
    with pytest.raises(ValueError, match="piecewise graphs need torch.compile"):
        CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")
    with pytest.raises(ValueError, match="positive integers"):
        CompilationConfig(cudagraph_capture_sizes=[4, 0])
    with pytest.raises(ValueError, match=r"Unknown compilation_config key\(s\) \['level'\]"):
        CompilationConfig.parse('{"level": 3}')
    assert CompilationConfig.parse('{"cudagraph_mode": "full"}').cudagraph_mode == "FULL"


def test_bad_compilation_config_fails_at_start(tiny_llama: str) -> None:
    from kvserve import EngineArgs
    with pytest.raises(ValueError, match="cudagraph_mode must be one of.*'PIECEWISE'"):
        EngineArgs(model=tiny_llama, device="cpu",
                   compilation_config='{"cudagraph_mode": "PIECEWISE"}').create_engine_config()
    with pytest.raises(ValueError, match="--compilation-config is not valid JSON"):
        EngineArgs(model=tiny_llama, device="cpu",
                   compilation_config="{cudagraph_mode: FULL}").create_engine_config()


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


def test_padded_mixed_step_attention(device: torch.device) -> None:
    """A mixed step as a FULL graph's bucket holds it (the runner's layout: requests padded
    with empty queries and seq_len 0, tokens padded to the bucket): its rows equal the
    unpadded step's bit for bit, and the padding rows (NaN queries here) come out 0."""
    from kvserve.attention.backends.triton import TritonAttentionBackend, TritonAttentionMetadata
    from kvserve.model.layers.attention import Attention
    from tests.utils import scattered_paged_cache

    gen = torch.Generator().manual_seed(3)
    H, hkv, D, bs = 4, 2, 32, 16
    q_lens, seq_lens = [9, 1, 1], [30, 17, 40]         # a chunk with context, two decodes
    n, b, r_pad = sum(q_lens), 16, 16
    cache, tables = scattered_paged_cache(seq_lens, hkv, D, bs, torch.float32, 1, gen)
    cache, tables = cache.to(device), tables.to(device, torch.int32)
    q = torch.randn(b, H, D, generator=gen).to(device)
    q[n:] = float("nan")
    layer = Attention(H, D, hkv, D ** -0.5)
    backend = TritonAttentionBackend(device)
    i32 = dict(dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 9, 10, 11], **i32)
    want = backend._attend(layer, q[:n], cache, TritonAttentionMetadata(
        torch.full((n,), -1, **i32), qsl, torch.tensor(seq_lens, **i32), tables, 3, False))
    pad_qsl = torch.cat([qsl, torch.full((r_pad - 3,), n, **i32)])
    pad_lens = torch.tensor(seq_lens + [0] * (r_pad - 3), **i32)
    pad_tables = torch.cat([tables, torch.zeros(r_pad - 3, tables.shape[1], **i32)])
    got = backend._attend(layer, q, cache, TritonAttentionMetadata(
        torch.full((b,), -1, **i32), pad_qsl, pad_lens, pad_tables, r_pad, False, padded=True))
    assert torch.equal(got[:n], want)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))


def test_mixed_bucket_staging_pads_requests() -> None:
    """A mixed step staged into a bucket after a step with more requests: the padding
    requests have no query (query_start_loc repeats the token count, never a stale smaller
    one: the unified kernel would give a padding request real rows) and seq_len 0, the
    padding tokens slot -1; the decode buckets' query_start_loc stays 0, 1, 2, ..."""
    from kvserve.attention.backends.triton import TritonAttentionMetadata

    runner = CUDAGraphRunner(torch.nn.Identity(), [], [1, 2, 4], 4, torch.device("cpu"),
                             mixed_sizes=[8, 16], max_num_seqs=6)
    i32 = dict(dtype=torch.int32)

    def step(q_lens: list[int], seq_lens: list[int]) -> tuple[bool, int]:
        n, r = sum(q_lens), len(q_lens)
        qsl = torch.tensor([0] + q_lens, **i32).cumsum(0).to(torch.int32)
        meta = TritonAttentionMetadata(torch.arange(n, **i32), qsl, torch.tensor(seq_lens, **i32),
                                       torch.ones(r, 3, **i32), r, False)
        bucket = runner.bucket(meta, n)
        assert bucket is not None
        runner.stage(torch.arange(n), torch.arange(n), meta, bucket)
        return bucket

    assert step([1, 1, 1, 7], [5, 6, 7, 20]) == (True, 16)
    assert step([3, 4], [9, 4]) == (True, 8)
    assert runner.mixed_query_start_loc[:7].tolist() == [0, 3, 7, 7, 7, 7, 7]
    assert runner.seq_lens[:6].tolist() == [9, 4, 0, 0, 0, 0]
    assert runner.slot_mapping[:8].tolist() == [0, 1, 2, 3, 4, 5, 6, -1]
    assert runner.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert runner.bucket(TritonAttentionMetadata(*[None] * 3, torch.ones(7, 3), 7, False),
                         17) is None          # above the largest mixed bucket: eager


@pytest.mark.parametrize("cap", [16, 8])
def test_full_graph_buckets_equal_eager(tiny_llama: str, device: torch.device, cap: int) -> None:
    """cudagraph_mode FULL through the runner's staging, on CPU (the kernels interpreted, the
    graphs emulated): 5 requests over a 16-token step budget give chunked prefills beside
    decodes and all-decode steps. Every step fits a bucket at cap 16 (mixed and decode
    replays); at cap 8 the larger mixed steps run eagerly. Tokens and logprobs equal a run
    without graphs."""
    from kvserve import LLM, SamplingParams
    from tests.utils import random_prompts

    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, 7, 30, vocab=1024, seed=6)]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              multiprocessing=False, device="cpu", attention_backend="TRITON_ATTN",
              kv_cache_memory=8 << 20, enable_prefix_caching=False,
              compilation_config={"cudagraph_mode": "FULL", "max_cudagraph_capture_size": cap})
    eager = LLM(tiny_llama, **kw).generate(prompts, sp, use_tqdm=False)
    llm = LLM(tiny_llama, **kw)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner
    decode, mixed = runner.graph_buckets()
    assert decode == [1, 2, 4] and mixed == [s for s in (1, 2, 4, 8, 16) if s <= cap]
    graphs = EmulatedGraphs(runner.model, runner.kv_caches, decode, runner.max_blocks_per_req,
                            runner.device, mixed_sizes=mixed, max_num_seqs=4)
    graphs.capture_buckets(graphs.buckets())
    runner.cuda_graphs = graphs
    got = llm.generate(prompts, sp, use_tqdm=False)
    _assert_close(got, eager, 1e-4)
    assert graphs.mixed_replays > 0 and graphs.replays > graphs.mixed_replays


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
    _assert_close(graphed, eager, 2e-2)


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
    assert graphs is not None and len(graphs.graphs) == 11          # 1, 2, 4, 8, ... 64
    assert len(graphs.plain_graphs) == (11 if lora else 0)
    took = graphs.memory_bytes + graphs.static_bytes()
    estimate = worker.memory_profile.cuda_graphs
    # The device reports memory in 2 MiB pages: a tiny model's graphs are a few of them.
    assert took > 0 and estimate + (8 << 20) >= took, (estimate, took)
    assert estimate <= 3 * took + (256 << 20), (estimate, took)
    # The profile's budget is what the cache got: the graphs were not left in it.
    eager = LLM(tiny_llama, dtype="bfloat16", max_model_len=256, max_num_seqs=64, device="cuda",
                multiprocessing=False, attention_backend="TRITON_ATTN", enforce_eager=True,
                **kw)
    assert eager.llm_engine.engine_core.engine_core.model_executor.worker.memory_profile \
        .cuda_graphs == 0


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_mode_mixed_graphs_equal_eager(tiny_llama: str, dtype: str) -> None:
    """cudagraph_mode FULL on a GPU: chunked prompts beside decodes (32-token steps) replay
    mixed buckets; tokens and logprobs equal an eager engine's."""
    from kvserve import LLM, SamplingParams
    from tests.utils import random_prompts

    prompts = [{"prompt_token_ids": p} for p in random_prompts(11, 5, 60, vocab=1024, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    kw = dict(dtype=dtype, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=32,
              multiprocessing=False, device="cuda", attention_backend="TRITON_ATTN",
              enable_prefix_caching=False)
    eager = LLM(tiny_llama, enforce_eager=True, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, compilation_config={"cudagraph_mode": "FULL"}, **kw)
    graphs = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.cuda_graphs
    assert graphs is not None and sorted(graphs.mixed_graphs) == [1, 2, 4, 8, 16, 24, 32]
    graphed = llm.generate(prompts, params, use_tqdm=False)
    _assert_close(graphed, eager, 2e-2)
    assert graphs.mixed_replays > 0 and graphs.replays > graphs.mixed_replays


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
