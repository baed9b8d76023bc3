"""Async scheduling (`async_scheduling=True`): the engine core schedules step N+1 before it
reads step N's output, with placeholders for step N's tokens. It must not change a thing:
every run here is compared with the same run scheduled synchronously."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from tests.utils import random_prompts

BASE = dict(dtype="float32", max_model_len=128, kv_cache_memory=16 << 20, seed=0,
            max_num_batched_tokens=32, multiprocessing=False)
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts(8, 5, 50, vocab=1024, seed=1)]
# Half of the prompts share a 20-token prefix (prefix cache hits in the second round).
PROMPTS = [{"prompt_token_ids": PROMPTS[0]["prompt_token_ids"][:20] + p["prompt_token_ids"]}
           if i % 2 else p for i, p in enumerate(PROMPTS)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),                # greedy
    SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
    # Stop tokens end requests at different steps; penalties read the token history.
    SamplingParams(temperature=1.0, seed=5, max_tokens=16, presence_penalty=0.5,
                   repetition_penalty=1.2, min_tokens=2, stop_token_ids=list(range(40, 90))),
    SamplingParams(temperature=1.0, seed=7, max_tokens=10, logprobs=2, ignore_eos=True),
]


def _summary(outs: list) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
             None if o.outputs[0].logprobs is None
             else [sorted(d) for d in o.outputs[0].logprobs]) for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


@pytest.fixture(scope="module")
def engines(tiny_llama: str) -> dict[bool, LLM]:
    """The same engine scheduled synchronously (False) and asynchronously (True). 12 blocks of
    16 tokens for 8 requests of up to 86 tokens: preemption; a token budget of 32: chunked
    prefill; prefix caching on."""
    return {a: LLM(tiny_llama, **BASE, num_gpu_blocks_override=12, async_scheduling=a)
            for a in (False, True)}


@pytest.fixture(scope="module")
def sync_reference(engines: dict[bool, LLM]) -> list:
    return _summary(engines[False].generate(PROMPTS, PARAMS * 2, use_tqdm=False))


def test_same_outputs(engines: dict[bool, LLM], sync_reference: list) -> None:
    """Greedy, seeded, stop tokens with penalties, logprobs; with preemption, chunked prefill
    and (second round) prefix cache hits."""
    llm = engines[True]
    for _ in range(2):
        assert _summary(llm.generate(PROMPTS, PARAMS * 2, use_tqdm=False)) == sync_reference
        _assert_all_blocks_free(llm)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    # The async run did schedule ahead: steps ran with placeholder tokens filled on the
    # device, so the two runs compared here had different schedules.
    runner = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner
    assert runner.async_tokens is not None and runner.async_tokens.num_filled > 0


def test_abort_mid_stream(engines: dict[bool, LLM], sync_reference: list) -> None:
    """Abort half of the requests after a few steps: the others finish exactly as in the
    synchronous run, the aborted ones end with a prefix of theirs, every block comes back."""
    engine = engines[True].llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", p, (PARAMS * 2)[i])
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        if steps == 6:
            outs += engine.abort_request([f"abort-{i}" for i in range(0, len(PROMPTS), 2)])
        for out in outs:
            if out.finished:
                finished[int(out.request_id.split("-")[1])] = out
    assert len(finished) == len(PROMPTS)
    for i, out in finished.items():
        tokens, reason, _ = sync_reference[i]
        if i % 2:
            assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (tokens, reason)
        else:
            assert out.outputs[0].finish_reason == "abort"
            assert out.outputs[0].token_ids == tokens[:len(out.outputs[0].token_ids)]
    _assert_all_blocks_free(engines[True])


def test_structured_outputs_and_stop_strings(engines: dict[bool, LLM]) -> None:
    from kvserve.sampling_params import StructuredOutputsParams
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(
                                 choice=["alpha", "beta gamma", "delta"])),
              SamplingParams(temperature=0.9, seed=12, max_tokens=12, stop=["e", "a "])]
    prompts, plist = PROMPTS[:6], [params[i % 2] for i in range(6)]
    runs = {a: [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                for o in llm.generate(prompts, plist, use_tqdm=False)]
            for a, llm in engines.items()}
    assert runs[True] == runs[False]
    assert {t for t, _, _ in runs[True][0::2]} <= {"alpha", "beta gamma", "delta"}
    assert any(r == "stop" for _, _, r in runs[True][1::2])
    _assert_all_blocks_free(engines[True])


@pytest.mark.parametrize("kw,match", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                              "prompt_lookup_max": 3}), "speculative decoding"),
    (dict(kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": "/tmp"}}),
     "kv_transfer_config"),
])
def test_unsupported_features_refused_at_start(tiny_llama: str, kw: dict, match: str) -> None:
    """What async scheduling does not run with is a clear error before anything starts."""
    args = EngineArgs(model=tiny_llama, **BASE, async_scheduling=True, **kw)
    with pytest.raises(ValueError, match=f"async_scheduling does not support {match}"):
        args.create_engine_config()


def test_cli_flag() -> None:
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert "--async-scheduling" in parser.format_help()
    ns = parser.parse_args(["--async-scheduling"])
    assert ns.async_scheduling is True


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_async_equals_sync(tiny_llama: str) -> None:
    """On a GPU the sampled ids come back through pinned memory on a side stream, the inputs
    go up from pinned buffers without a sync, and TRITON_ATTN fuses rotary + KV write: still
    the synchronous run's tokens (with CUDA graphs and without)."""
    kw = dict(BASE, device="cuda", num_gpu_blocks_override=12)
    for eager in (False, True):
        runs = [_summary(LLM(tiny_llama, **kw, enforce_eager=eager, async_scheduling=a)
                         .generate(PROMPTS, PARAMS * 2, use_tqdm=False)) for a in (False, True)]
        assert runs[0] == runs[1]
