"""kv_cache_dtype (vLLM's --kv-cache-dtype): a bfloat16 KV cache beside float32 activations on
CPU. It holds twice the tokens in the same memory and follows the float32-cache run up to bf16
rounding (greedy equal, or a near-tie where they first part); bad values fail before anything
is scheduled."""
from __future__ import annotations

import argparse
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from tests.utils import greedy_prefix_near_tie, random_prompts

ENGINE_KW = dict(max_model_len=256, kv_cache_memory=8 << 20, seed=0, multiprocessing=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
# bf16 rounding of K, V and q moves a logprob by ~1e-3 on the tiny models (a random one's are
# near-uniform); 0.03 leaves room without letting a wrong cache (a 1e-1-scale error) through.
LOGPROB_ATOL = 3e-2


def runner_of(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner


def assert_close_to(ref: Any, out: Any, name: str) -> int:
    """Tokens equal with logprobs within LOGPROB_ATOL; at a first divergence each side's token
    is in the other's top 5. Returns the positions that matched."""
    a, b = ref.outputs[0], out.outputs[0]
    matched = greedy_prefix_near_tie(a, b, name)
    for i in range(matched):
        x = a.token_ids[i]
        diff = abs(a.logprobs[i][x].logprob - b.logprobs[i][x].logprob)
        assert diff < LOGPROB_ATOL, f"{name} pos {i}: logprob differs by {diff:.4f}"
    return matched


@pytest.mark.parametrize("backend", ["CPU_ATTN", "TORCH_SDPA"])
def test_bf16_cache_follows_float32_cache(tiny_llama: str, backend: str) -> None:
    """Chunked prefill with cached context (16-token budget), mixed and all-decode steps, the
    fused decode path (CPU_ATTN) and the torch path: a bf16 cache gives the float32 cache's
    tokens and logprobs up to bf16 rounding, in twice the blocks."""
    path = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 9, 40, vocab=1024, seed=3)]
    kw = dict(ENGINE_KW, dtype="float32", attention_backend=backend, max_num_batched_tokens=16)
    plain = LLM(path, **kw)
    refs = plain.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, kv_cache_dtype="bfloat16", **kw)
    runner, plain_runner = runner_of(llm), runner_of(plain)
    assert {c.dtype for c in runner.kv_caches} == {torch.bfloat16}
    assert {c.dtype for c in plain_runner.kv_caches} == {torch.float32}
    assert runner.kv_caches[0].shape[1] == 2 * plain_runner.kv_caches[0].shape[1]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    matched = sum(assert_close_to(r, o, f"{backend}[{i}]")
                  for i, (r, o) in enumerate(zip(refs, outs)))
    assert matched >= 0.8 * len(prompts) * GREEDY.max_tokens


def test_auto_is_the_model_dtype(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", **ENGINE_KW)
    assert llm.llm_engine.config.cache_config.kv_cache_dtype == torch.float32
    assert {c.dtype for c in runner_of(llm).kv_caches} == {torch.float32}


@pytest.mark.parametrize("value,message", [
    ("fp8", "fp8 KV caches are not supported"),
    ("float16", "float32 or bfloat16"),
    ("int4", "Unknown kv_cache_dtype"),
])
def test_bad_values_fail_before_start(tiny_llama: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, dtype="float32", kv_cache_dtype=value, **ENGINE_KW)


def test_cli_flag() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "bfloat16"]))
    assert args.kv_cache_dtype == "bfloat16"
