"""LLM.embed / LLM.encode on tiny random checkpoints against transformers' hidden states.

One engine per pooling setup, each with a 64-token step budget, so that one batch holds
prompts pooled whole in a shared step (5, 17, 40 tokens), prompts chunk-prefilled over
several steps (150, 65 tokens) and one exactly the budget (64). The reference pools
AutoModel's last_hidden_state of each prompt alone: cosine >= 0.9999 (float32).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.pooling_params import PoolingParams
from tests.pooling.conftest import hf_pooled
from tests.utils import random_prompts

pytestmark = pytest.mark.timeout(300)

LENGTHS = (5, 17, 40, 150, 3, 64, 65)
PROMPTS = [random_prompts(1, n, n, 1024, seed=n)[0] for n in LENGTHS]
ENGINE_KW = dict(runner="pooling", dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
                 max_num_batched_tokens=64, multiprocessing=False)


def _cosines(got: list, ref: list[torch.Tensor]) -> list[float]:
    return [torch.nn.functional.cosine_similarity(torch.as_tensor(g, dtype=torch.float32), r,
                                                  dim=0).item() for g, r in zip(got, ref)]


def _check(got: list, ref: list[torch.Tensor], normalized: bool) -> None:
    cos = _cosines(got, ref)
    assert min(cos) >= 0.9999, dict(zip(LENGTHS, cos))
    norms = [float(torch.as_tensor(g).norm()) for g in got]
    if normalized:
        assert all(abs(n - 1) < 1e-4 for n in norms), norms
    else:   # the raw hidden states' scale, not a unit vector
        torch.testing.assert_close(torch.tensor(norms), torch.stack([r.norm() for r in ref]),
                                   rtol=1e-3, atol=1e-3)


def test_last_normalized_default(tiny_qwen3: str) -> None:
    """No sentence-transformers config: the decoder-embedder default, LAST + normalize; the
    engine refuses generation and Matryoshka `dimensions` it does not declare."""
    llm = LLM(tiny_qwen3, **ENGINE_KW)
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        assert [len(o.prompt_token_ids) for o in outs] == list(LENGTHS)
        _check([o.outputs.embedding for o in outs], hf_pooled(tiny_qwen3, PROMPTS, "LAST", True),
               normalized=True)
        with pytest.raises(ValueError, match="pooling runner"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="matryoshka"):
            llm.embed([PROMPTS[0]], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
        # The engine kept serving, and freed every KV block (none kept after pooling).
        again = llm.encode(PROMPTS[:2], PoolingParams(normalize=False), use_tqdm=False)
        _check([o.outputs.data for o in again],
               hf_pooled(tiny_qwen3, PROMPTS[:2], "LAST", False), normalized=False)
        stats = llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,pooling,normalize,hf_pooling", [
    ("llama", "mean", True, "MEAN"),
    ("qwen3", "cls", False, "CLS"),
])
def test_sentence_transformers_pooling(make_checkpoint, st_checkpoint, arch: str, pooling: str,
                                       normalize: bool, hf_pooling: str) -> None:
    base = make_checkpoint(arch, **({"head_dim": 32} if arch == "qwen3" else {}))
    model = st_checkpoint(base, pooling, normalize, config_extra={"is_matryoshka": True})
    llm = LLM(model, **ENGINE_KW)
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        _check([o.outputs.embedding for o in outs],
               hf_pooled(model, PROMPTS, hf_pooling, normalize), normalized=normalize)
        # Unnormalised (per request): the scale is checked too (MEAN divides by the prompt
        # length, whatever the chunks were).
        raw = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], PoolingParams(normalize=False),
                         use_tqdm=False)
        _check([o.outputs.data for o in raw], hf_pooled(model, PROMPTS, hf_pooling, False),
               normalized=False)
        # Matryoshka: the first `dimensions` values, then normalised (as vLLM does).
        dims: Optional[int] = 16
        short = llm.embed([{"prompt_token_ids": p} for p in PROMPTS],
                          pooling_params=PoolingParams(dimensions=dims, normalize=True),
                          use_tqdm=False)
        assert all(len(o.outputs.embedding) == dims for o in short)
        _check([o.outputs.embedding for o in short],
               hf_pooled(model, PROMPTS, hf_pooling, True, dims), normalized=True)
    finally:
        llm.shutdown()
