"""Checkpoints for the speculative decoding tests."""
from __future__ import annotations

from typing import Callable

import pytest

from kvserve import LLM, SamplingParams
from tests.utils import peaked_copy, random_prompts

BASE = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts() -> list[dict]:
    """Random prompts, and prompts made of a short phrase repeated (n-gram matches at once)."""
    plain = random_prompts(8, 10, 60, vocab=1024, seed=1)
    repeated = [p * 4 for p in random_prompts(8, 4, 9, vocab=1024, seed=2)]
    return [{"prompt_token_ids": p} for p in plain + repeated]


@pytest.fixture(scope="session")
def baseline(tiny_llama: str) -> list:
    """tiny_llama's greedy outputs for prompts(), without speculation."""
    llm = LLM(tiny_llama, **BASE)
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    llm.shutdown()
    return outs


@pytest.fixture(scope="session")
def peaked_llama(make_checkpoint: Callable[..., str],
                 tmp_path_factory: pytest.TempPathFactory) -> str:
    """tiny_llama's architecture with its LM head scaled x5 (peaked: a wrong sampling rule
    shows in a chi-square test)."""
    return peaked_copy(make_checkpoint("llama"), str(tmp_path_factory.mktemp("peaked_llama")))
