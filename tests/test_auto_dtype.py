"""dtype="auto" on a 16-bit checkpoint: on a CPU without bf16 math (every tier below
avx512_bf16, or one forced with KVSERVE_CPU_ISA) the weights stay 16-bit in memory and the math
is float32, so greedy output follows Hugging Face's float32 run on the same checkpoint.

tests/ops/test_cpu_isa.py runs this file again for every other tier the host supports."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.ops import cpu_isa
from tests.utils import check_greedy_close, hf_greedy, random_prompts

MAX_TOKENS = 10
ENGINE_KW = dict(max_model_len=256, kv_cache_memory=16 << 20, seed=0)


@pytest.mark.parametrize("save_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_auto_dtype_greedy_matches_hf_float32(make_checkpoint: Callable[..., str],
                                              save_dtype: torch.dtype) -> None:
    path = make_checkpoint("llama", save_dtype=save_dtype)
    prompts = random_prompts(4, 3, 60, vocab=1024, seed=5)
    refs = hf_greedy(path, prompts, MAX_TOKENS)            # HF float32 on the 16-bit weights
    llm = LLM(path, dtype="auto", **ENGINE_KW)
    mc = llm.llm_engine.config.model_config
    if cpu_isa.has_native_bf16():
        assert mc.weight_dtype is None                     # native bf16: today's meaning
        pytest.skip("this tier has bf16 math: auto runs the checkpoint's dtype")
    assert (mc.dtype, mc.weight_dtype) == (torch.float32, save_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    matched = sum(check_greedy_close(ref_tokens, ref_lps, out, name=f"auto[{i}]")
                  for i, ((ref_tokens, ref_lps), out) in enumerate(zip(refs, outs)))
    assert matched >= 0.8 * len(prompts) * MAX_TOKENS
