"""Phi-3 (fused qkv_proj / gate_up_proj checkpoint matrices, LongRoPE) against transformers,
float32 greedy; tiny random checkpoints written by transformers' Phi3Config."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import TINY_CONFIG
from tests.utils import check_greedy_close, hf_greedy, random_prompts

MAX_TOKENS = 10
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, seed=0,
                 multiprocessing=False)
PHI3_LOGPROB_ATOL = 1e-3


def _build(out_dir: str, tokenizer_dir: str, **overrides: Any) -> str:
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(**{**TINY_CONFIG, "pad_token_id": 0, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(out_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, f)
    return out_dir


# LongRoPE as Phi-3-*-128k configs carry it: per-dimension short / long factors (head_dim 16:
# 8 each), max_position_embeddings 4x the original, so the attention factor is not 1.
LONGROPE = dict(max_position_embeddings=2048, original_max_position_embeddings=512,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                 "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0],
                                 "original_max_position_embeddings": 512})


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_phi3_greedy_matches_transformers(rope: str, tmp_path, demo_tokenizer_dir: str) -> None:
    path = _build(str(tmp_path), demo_tokenizer_dir, **(LONGROPE if rope == "longrope" else {}))
    prompts = random_prompts(5, 3, 70, vocab=1024, seed=5)
    refs = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(path, **ENGINE_KW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    matched = 0
    for i, ((ref_tokens, ref_lps), out) in enumerate(zip(refs, outs)):
        n = check_greedy_close(ref_tokens, ref_lps, out, name=f"phi3 {rope}[{i}]")
        for pos in range(n):
            got = out.outputs[0].logprobs[pos][ref_tokens[pos]].logprob
            assert abs(got - ref_lps[pos][ref_tokens[pos]].item()) < PHI3_LOGPROB_ATOL
        matched += n
    assert matched >= 0.8 * len(prompts) * MAX_TOKENS
    if rope == "longrope":
        # Past original_max_position_embeddings transformers switches factors: a clear error.
        with pytest.raises(ValueError, match="original_max_position_embeddings"):
            LLM(path, **{**ENGINE_KW, "max_model_len": 1024})
