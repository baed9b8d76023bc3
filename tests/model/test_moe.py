"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against Hugging Face transformers,
and the routing / grouped-experts ops against float64 references.

Tiny random checkpoints are written by transformers itself (2 layers, hidden 64, 8 experts,
top-2): float32 greedy tokens must equal HF `generate` (or the near-tie rule of tests/utils.py)
with logprobs within MOE_LOGPROB_ATOL, for a plain run, chunked prefill, prefix caching,
preemption and TP=2. Their decode steps (<= 8 tokens) run all layers in the fused C++ decode
op (fused_decode.py; test_greedy_matches_transformers asserts it ran; its bit-identity with the
layer path: test_fused_decode_moe.py).
"""
from __future__ import annotations

import json
import random
import shutil
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.model.layers.fused_moe import fused_experts_torch, select_experts
from tests.utils import check_greedy_close, hf_greedy, random_prompts

MOE_LOGPROB_ATOL = 1e-3
MAX_TOKENS = 10
# In-process engine cores: the least start-up cost on this shared machine.
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, seed=0,
                 multiprocessing=False)
MOE_CONFIG = dict(num_experts_per_tok=2, intermediate_size=128)


# Per architecture: the config beyond tests/conftest.py's TINY_CONFIG.
MOE_OVERRIDES: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8),
    # renormalised top-k weights
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=128, norm_topk_prob=True, head_dim=32),
    # a shared expert; layer 0 dense (mlp_only_layers)
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=96, shared_expert_intermediate_size=64,
                      norm_topk_prob=False, mlp_only_layers=[0]),
}


@pytest.fixture(scope="module")
def moe_checkpoint(make_checkpoint: Callable[..., str]) -> Callable[[str], str]:
    return lambda arch: make_checkpoint(arch, **MOE_CONFIG, **MOE_OVERRIDES[arch])


def _prompts() -> list[list[int]]:
    """6 prompts, 3 pairs sharing a 40-token prefix (prefix caching has something to hit)."""
    rng = random.Random(7)
    prefixes = random_prompts(3, 40, 40, vocab=1024, seed=11)
    return [prefixes[i % 3] + [rng.randrange(5, 1024) for _ in range(rng.randint(1, 30))]
            for i in range(6)]


@pytest.fixture(scope="module")
def hf_refs(moe_checkpoint: Callable[[str], str]) -> Callable[[str], list]:
    cache: dict[str, list] = {}

    def get(arch: str) -> list:
        if arch not in cache:
            cache[arch] = hf_greedy(moe_checkpoint(arch), _prompts(), MAX_TOKENS)
        return cache[arch]

    return get


def assert_matches_hf(refs: list, outs: list, what: str, atol: float = MOE_LOGPROB_ATOL) -> None:
    """Greedy tokens = HF's (or tests/utils.py's near-tie rule), logprobs within atol."""
    matched = 0
    for i, ((ref_tokens, ref_lps), out) in enumerate(zip(refs, outs)):
        n = check_greedy_close(ref_tokens, ref_lps, out, name=f"{what}[{i}]")
        for pos in range(n):
            got = out.outputs[0].logprobs[pos][ref_tokens[pos]].logprob
            want = ref_lps[pos][ref_tokens[pos]].item()
            assert abs(got - want) < atol, f"{what}[{i}] pos {pos}: {got} vs HF {want}"
        matched += n
    # Near-ties are rare: most positions must match exactly.
    assert matched >= 0.8 * sum(len(r[0]) for r in refs), (what, matched)


def _generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)


# ---- routing and grouped experts against float64 -------------------------------------------

def _reference_routing(logits: torch.Tensor, top_k: int, family: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, per token. Mixtral: softmax over the top-k LOGITS; Qwen: softmax over all,
    top-k, renormalised only for 'qwen_norm'."""
    logits = logits.double()
    weights, ids = [], []
    for row in logits:
        order = sorted(range(len(row)), key=lambda e: -row[e].item())[:top_k]
        if family == "mixtral":
            w = torch.softmax(row[order], dim=0)
        else:
            w = torch.softmax(row, dim=0)[order]
            if family == "qwen_norm":
                w = w / w.sum()
        weights.append(w)
        ids.append(order)
    return torch.stack(weights), torch.tensor(ids)


@pytest.mark.parametrize("family,renormalize", [("mixtral", True), ("qwen_norm", True),
                                                ("qwen", False)])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_select_experts_matches_float64(family: str, renormalize: bool, top_k: int) -> None:
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(37, 8, generator=gen) * 2
    weights, ids = select_experts(logits, top_k, renormalize)
    ref_w, ref_ids = _reference_routing(logits, top_k, family)
    assert ids.shape == (37, top_k) and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, atol=1e-6, rtol=0)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(37), atol=1e-6, rtol=0)


def test_select_experts_rejects_bad_top_k() -> None:
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.zeros(2, 4), 5, True)


def _reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            gate_up = w13[e] @ x[t]
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, j] * (w2[e] @ h)
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 33])
def test_fused_experts_matches_float64(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    E, H, inter, k = 8, 48, 40, 2
    x = torch.randn(num_tokens, H, generator=gen)
    w13 = torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=gen) / inter ** 0.5
    # Experts 5 and 6 never chosen: skipped experts must not disturb the grouping.
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, 5:7] = -30
    weights, ids = select_experts(logits, k, renormalize=False)
    got = fused_experts_torch(x, w13, w2, weights, ids)
    want = _reference_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


# ---- end to end against transformers ------------------------------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_greedy_matches_transformers(arch: str, moe_checkpoint, hf_refs) -> None:
    llm = LLM(moe_checkpoint(arch), **ENGINE_KW)
    assert_matches_hf(hf_refs(arch), _generate(llm), arch)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner
    stack = runner.model.model._fused_decode       # the decode steps ran in the fused op
    assert stack is not None and stack.has_moe and stack.steps >= MAX_TOKENS - 1, arch


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["chunked", "prefix_cached", "preempted"])
def test_scheduling_modes_match_transformers(arch: str, mode: str, moe_checkpoint,
                                             hf_refs) -> None:
    kw: dict = dict(enable_prefix_caching=False)
    if mode == "chunked":
        kw = dict(enable_prefix_caching=False, max_num_batched_tokens=16)
    elif mode == "prefix_cached":
        kw = dict(enable_prefix_caching=True)
    elif mode == "preempted":
        # 8 blocks of 16 tokens for 6 requests of 44-80 tokens: they cannot all fit.
        kw = dict(enable_prefix_caching=False, num_gpu_blocks_override=8, max_model_len=128)
    llm = LLM(moe_checkpoint(arch), **{**ENGINE_KW, **kw})
    outs = _generate(llm)
    if mode == "prefix_cached":
        outs = _generate(llm)      # the second round hits the first round's blocks
        assert llm.get_stats()["prefix_cache_hits"] >= 6 * 32
    if mode == "preempted":
        assert llm.get_stats()["num_preemptions"] > 0
    assert_matches_hf(hf_refs(arch), outs, f"{arch} {mode}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_tp2_matches_transformers(arch: str, moe_checkpoint, hf_refs) -> None:
    """Each rank holds a slice of every expert's intermediate dim; partial sums all-reduced
    (Qwen2-MoE: the shared expert's too)."""
    with LLM(moe_checkpoint(arch), tensor_parallel_size=2, device="cpu",
             **ENGINE_KW) as llm:
        outs = _generate(llm)
    assert_matches_hf(hf_refs(arch), outs, f"{arch} tp2")


def test_bad_moe_config_is_a_clear_error(moe_checkpoint, tmp_path) -> None:
    src = moe_checkpoint("mixtral")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["num_local_experts"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="num_local_experts"):
        LLM(str(bad), **ENGINE_KW)
