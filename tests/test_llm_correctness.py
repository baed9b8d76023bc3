"""kvserve against the Hugging Face transformers reference on the same checkpoints (float32)."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.utils import check_greedy_close, hf_greedy, hf_prompt_logprobs, random_prompts, LOGPROB_ATOL

ENGINE_KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20, seed=0)
MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_matches_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(arch)
    prompts = random_prompts(6, 3, 70, vocab=1024, seed=1)
    refs = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(path, **ENGINE_KW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    matched = 0
    for i, ((ref_tokens, ref_lps), out) in enumerate(zip(refs, outs)):
        matched += check_greedy_close(ref_tokens, ref_lps, out, name=f"{arch}[{i}]")
    # Near-ties are rare: most positions must match exactly.
    assert matched >= 0.8 * len(prompts) * MAX_TOKENS


def test_prompt_logprobs_match_transformers(tiny_llama: str) -> None:
    prompt = random_prompts(1, 40, 40, vocab=1024, seed=2)[0]
    want = hf_prompt_logprobs(tiny_llama, prompt)
    # A small budget forces the prompt through several chunks: logprobs must stitch together.
    llm = LLM(tiny_llama, **ENGINE_KW, max_num_batched_tokens=16)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    got = [out.prompt_logprobs[i + 1][t].logprob for i, t in enumerate(prompt[1:])]
    assert len(got) == len(want)
    for g, w in zip(got, want.tolist()):
        assert abs(g - w) < LOGPROB_ATOL
    for pos in out.prompt_logprobs[1:]:
        assert 1 <= len(pos) <= 3   # the prompt token plus the top 2


def test_bfloat16_close_to_float32(tiny_llama: str) -> None:
    prompts = random_prompts(4, 8, 40, vocab=1024, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    f32 = LLM(tiny_llama, **ENGINE_KW).generate(inputs, params, use_tqdm=False)
    bf16 = LLM(tiny_llama, **{**ENGINE_KW, "dtype": "bfloat16"}).generate(inputs, params, use_tqdm=False)
    for a, b in zip(f32, bf16):
        t = a.outputs[0].token_ids[0]
        lp_a = a.outputs[0].logprobs[0][t].logprob
        lp_b = b.outputs[0].logprobs[0].get(t)
        # bf16 keeps ~3 significant digits: the first token's logprob agrees loosely.
        if lp_b is not None:
            assert abs(lp_a - lp_b.logprob) < 0.1
