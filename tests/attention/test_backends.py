"""Attention backend selection, and whole engines on each backend against HF transformers.

TRITON_ATTN runs its kernels under Triton's CPU interpreter here (natively on a GPU box): the
end-to-end runs are kept tiny (2-layer model, short prompts) because the interpreter is slow.
"""
from __future__ import annotations

import logging

import pytest

from kvserve import LLM, EngineArgs, SamplingParams
from kvserve.attention import default_backend_name, resolve_backend_name
from tests.attention.conftest import DEVICE
from tests.utils import assert_same_outputs, check_greedy_close, hf_greedy, random_prompts

ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, seed=0,
                 multiprocessing=False, device=DEVICE.type)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)


def test_defaults_and_bad_names(tiny_llama: str, monkeypatch) -> None:
    assert default_backend_name("cpu") == "CPU_ATTN"
    assert default_backend_name("cuda") == "TRITON_ATTN"
    assert resolve_backend_name(None, "cpu", 16, 64) == "CPU_ATTN"
    assert resolve_backend_name("torch_sdpa", "cpu", 16, 64) == "TORCH_SDPA"
    with pytest.raises(ValueError, match="Unknown attention_backend 'FLASH_ATTN'.*CPU_ATTN"):
        resolve_backend_name("FLASH_ATTN", "cpu", 16, 64)
    with pytest.raises(ValueError, match="CPU_ATTN runs on CPU only"):
        resolve_backend_name("CPU_ATTN", "cuda", 16, 64)
    with pytest.raises(ValueError, match="block_size must be one of"):
        resolve_backend_name("TRITON_ATTN", "cuda", 8, 64)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend_name("TRITON_ATTN", "cpu", 16, 64)
    # Through the engine arguments: an error before anything starts.
    with pytest.raises(ValueError, match="Unknown attention_backend"):
        EngineArgs(model=tiny_llama, attention_backend="NOPE", device="cpu").create_engine_config()


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "TORCH_SDPA"])
def test_greedy_matches_transformers(tiny_llama: str, backend: str, caplog) -> None:
    """Three prompts in one batch with a 16-token budget: prefill chunks with cached context,
    mixed prefill + decode steps and all-decode steps; logged choice; greedy = HF."""
    prompts = random_prompts(3, 9, 30, vocab=1024, seed=5)
    refs = hf_greedy(tiny_llama, prompts, GREEDY.max_tokens)
    with caplog.at_level(logging.INFO, logger="kvserve.attention.selector"):
        llm = LLM(tiny_llama, attention_backend=backend, max_num_batched_tokens=16,
                  **ENGINE_KW)
    assert f"Using {backend} attention backend" in caplog.text
    runner = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner
    layers = [m for m in runner.model.modules() if hasattr(m, "backend")]
    assert len(layers) == 2 and all(m.backend.name == backend for m in layers)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, ((ref_tokens, ref_lps), out) in enumerate(zip(refs, outs)):
        check_greedy_close(ref_tokens, ref_lps, out, name=f"{backend}[{i}]")


def test_triton_prefix_hits_match_plain_run(tiny_llama: str) -> None:
    """A second batch sharing a 2-block prefix with the first: prefix-cache hits (the cached
    blocks read by the unified kernel as context) give the same tokens and logprobs as
    CPU_ATTN without prefix caching."""
    prefix = random_prompts(1, 33, 33, vocab=1024, seed=8)[0]
    tails = random_prompts(2, 3, 6, vocab=1024, seed=9)
    prompts = [{"prompt_token_ids": prefix + t} for t in tails]
    plain = LLM(tiny_llama, enable_prefix_caching=False, **{**ENGINE_KW, "device": "cpu"})
    want = plain.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(tiny_llama, attention_backend="TRITON_ATTN", **ENGINE_KW)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in got), [o.num_cached_tokens for o in got]
    assert_same_outputs(got, want, "TRITON_ATTN with prefix hits vs CPU_ATTN")


def test_attention_layer_has_no_default_backend() -> None:
    """A layer runs only through the backend bound to it: unbound is an error, not CPU_ATTN."""
    import torch

    from kvserve.attention.backends.cpu import CpuAttentionBackend
    from kvserve.model.layers.attention import Attention, bind_attention_backend

    layer = Attention(num_heads=2, head_dim=8, num_kv_heads=1)
    q, kv = torch.zeros(1, 16), torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="no backend"):
        layer(q, kv, kv, torch.zeros(2, 1, 4, 1, 8), None)
    backend = CpuAttentionBackend(torch.device("cpu"))
    bind_attention_backend(torch.nn.Sequential(layer), backend)
    assert layer.backend is backend
