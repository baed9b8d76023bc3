"""Phi-3 (fused qkv_proj / gate_up_proj checkpoint matrices, LongRoPE) against transformers,
float32 greedy; tiny random checkpoints written by transformers' Phi3Config."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.model.test_moe import assert_matches_hf
from tests.utils import hf_greedy, random_prompts

MAX_TOKENS = 10
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, seed=0,
                 multiprocessing=False)
PHI3_LOGPROB_ATOL = 1e-3


# LongRoPE as Phi-3-*-128k configs carry it: per-dimension short / long factors (head_dim 16:
# 8 each), max_position_embeddings 4x the original, so the attention factor is not 1.
LONGROPE = dict(max_position_embeddings=2048, original_max_position_embeddings=512,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                 "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0],
                                 "original_max_position_embeddings": 512})


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_phi3_greedy_matches_transformers(rope: str, make_checkpoint) -> None:
    # Phi3Config's pad_token_id (32000) lies outside the tiny vocabulary.
    path = make_checkpoint("phi3", pad_token_id=0, **(LONGROPE if rope == "longrope" else {}))
    prompts = random_prompts(5, 3, 70, vocab=1024, seed=5)
    refs = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(path, **ENGINE_KW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches_hf(refs, outs, f"phi3 {rope}", atol=PHI3_LOGPROB_ATOL)
    if rope == "longrope":
        # Past original_max_position_embeddings transformers switches factors: a clear error.
        with pytest.raises(ValueError, match="original_max_position_embeddings"):
            LLM(path, **{**ENGINE_KW, "max_model_len": 1024})
