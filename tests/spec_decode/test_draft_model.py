"""Draft-model speculation: greedy outputs identical to a plain run (chunked prefill, prefix
caching, preemption, TP=2), the target as its own draft accepts every draft (its own paged KV
cache is right), and bad configurations fail before any process starts."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Callable

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from tests.spec_decode.conftest import BASE, GREEDY, prompts
from tests.spec_decode.test_spec_decode import assert_all_blocks_free, assert_spec_metrics_add_up
from tests.utils import assert_same_outputs


def draft_config(path: str, **kw) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
            "disable_by_batch_size": None, "min_acceptance_rate": 0.0, **kw}


@pytest.fixture(scope="module")
def small_draft(make_checkpoint: Callable[..., str]) -> str:
    return make_checkpoint("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1)


def test_small_draft_greedy_identical(tiny_llama: str, small_draft: str, baseline: list) -> None:
    llm = LLM(tiny_llama, **BASE, speculative_config=draft_config(small_draft))
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert_same_outputs(baseline, outs, "small draft model")
    spec = llm.get_stats()["spec_decoding"]
    assert spec["num_draft_tokens"] > 0 and spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=64, num_gpu_blocks_override=64, block_size=8),
    dict(tensor_parallel_size=2),
], ids=["chunked-preempt", "tp2-prefix"])
def test_target_as_own_draft_accepts_everything(tiny_llama: str, baseline: list,
                                                kw: dict) -> None:
    """Every draft of a model drafting for itself is accepted, whatever the scheduling: the
    draft's KV (own tensors, the target's block ids, lookahead slots) is exactly right."""
    llm = LLM(tiny_llama, **BASE, **kw, speculative_config=draft_config(tiny_llama))
    outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    second = llm.generate(prompts(), GREEDY, use_tqdm=False)   # prefix cache hits
    assert_same_outputs(baseline, outs, f"target as draft {kw}")
    assert_same_outputs(baseline, second, f"target as draft {kw} (again)")
    spec = assert_spec_metrics_add_up(llm, min_accepted=100)
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"], spec
    stats = llm.get_stats()
    if "num_gpu_blocks_override" in kw:
        assert stats["num_preemptions"] > 0, stats
    else:   # (a pool small enough to preempt evicts every prefix before it is asked again)
        assert stats["prefix_cache_hits"] > 0, stats
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_bad_speculative_configs_fail_before_start(tiny_llama: str, small_draft: str,
                                                   make_checkpoint: Callable[..., str],
                                                   tmp_path) -> None:
    other_vocab = make_checkpoint("llama", vocab_size=512, num_hidden_layers=1)
    other_tok = str(tmp_path / "other_tokenizer")
    shutil.copytree(small_draft, other_tok)
    with open(os.path.join(other_tok, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100], list(vocab)[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]          # two token ids swapped
    with open(os.path.join(other_tok, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    cases = [
        ({"method": "lookahead"}, "Unknown speculative decoding method"),
        ({"method": "eagle3", "model": small_draft}, "not supported by kvserve yet"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "draft_model"}, "needs 'model'"),
        ({"method": "draft_model", "model": str(tmp_path / "missing")}, "not found"),
        (draft_config(other_vocab), "vocab_size"),
        (draft_config(other_tok), "different tokenizer"),
        ({"method": "ngram", "speculative_tokens": 3}, "Unknown speculative_config key"),
        ("{not json", "not valid JSON"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(tiny_llama, **BASE, speculative_config=cfg)
    # The CLI flag takes the same JSON.
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", tiny_llama, "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 2
    assert config.speculative_config.prompt_lookup_min == 5   # vLLM's default


def test_draft_kv_caught_up_lazily(tiny_llama: str, baseline: list) -> None:
    """No drafts while more than 2 requests run: the draft model does not run then, and when
    the batch has shrunk its KV is caught up over every missed token in one forward. The
    target as its own draft must still accept every draft (its KV is exactly right)."""
    ps = prompts()
    lengths = [40 if i in (0, 9) else 4 + i for i in range(len(ps))]   # 2 run long
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    llm = LLM(tiny_llama, **BASE, speculative_config=draft_config(
        tiny_llama, disable_by_batch_size=2))
    outs = llm.generate(ps, params, use_tqdm=False)
    for out, ref, m in zip(outs, baseline, lengths):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids[:m]
    spec = assert_spec_metrics_add_up(llm, min_accepted=20)
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"], spec
    assert_all_blocks_free(llm)
    llm.shutdown()
