"""Structured outputs offline (LLM + LLMEngine): every kind valid at temperature 1.0, free
requests untouched, scheduling features, abort while compiling, bad input."""
from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.core.request import RequestStatus
from kvserve.sampling_params import StructuredOutputsParams as SO
from tests.structured_output.conftest import (CHOICES, EBNF, ENGINE, PERSON_SCHEMA, REGEX,
                                              check_output, json_skeleton, load_json)
from tests.utils import random_prompts

KINDS: list[tuple[str, Any]] = [("json", PERSON_SCHEMA), ("json_object", True), ("regex", REGEX),
                                ("choice", CHOICES), ("grammar", EBNF)]
NUM_SEEDS = 12


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    llm = LLM(tiny_llama, **ENGINE, multiprocessing=False)
    yield llm
    llm.shutdown()


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats


def sampled(kind: str, spec: Any, n: int = NUM_SEEDS, max_tokens: int = 60, **so_kw: Any
            ) -> list[SamplingParams]:
    if kind in ("json", "json_object"):
        # A random model pads JSON with whitespace until max_tokens unless told not to.
        so_kw.setdefault("disable_any_whitespace", True)
    return [SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                           structured_outputs=SO(**{kind: spec}, **so_kw)) for seed in range(n)]


def test_every_kind_valid_at_temperature_one(llm: LLM) -> None:
    """All kinds in one batch, many seeds: every finished output obeys its constraint."""
    prompts, params, kinds = [], [], []
    for i, (kind, spec) in enumerate(KINDS):
        ps = sampled(kind, spec)
        params += ps
        kinds += [(kind, spec)] * len(ps)
        prompts += random_prompts(len(ps), 3, 20, vocab=700, seed=i)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finished = {k: 0 for k, _ in KINDS}
    for out, (kind, spec) in zip(outs, kinds):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            finished[kind] += 1
            assert check_output(kind, spec, c.text), (kind, c.text)
        else:   # cut by max_tokens: what there is must still be a prefix of a valid output
            assert c.finish_reason == "length", c.finish_reason
    # A random model still finishes several of each (an open JSON object the fewest).
    for kind, n in finished.items():
        assert n >= 2, (kind, finished)
    assert_all_blocks_free(llm)


def test_disable_any_whitespace(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(NUM_SEEDS, 3, 20, vocab=700, seed=7)]
    tight = llm.generate(prompts, sampled("json", PERSON_SCHEMA, disable_any_whitespace=True),
                         use_tqdm=False)
    loose = llm.generate(prompts, sampled("json", PERSON_SCHEMA, max_tokens=120,
                                          disable_any_whitespace=False), use_tqdm=False)
    for out in tight:
        text = out.outputs[0].text
        if out.outputs[0].finish_reason != "stop":
            continue
        skeleton = json_skeleton(text)
        # No whitespace at all outside strings: compact separators.
        assert skeleton == json.dumps(load_json(skeleton), separators=(",", ":")), text
    # Without the flag the random model does pad with whitespace (so the check above can fail).
    assert any(json_skeleton(o.outputs[0].text) != json.dumps(load_json(json_skeleton(
        o.outputs[0].text)), separators=(",", ":"))
        for o in loose if o.outputs[0].finish_reason == "stop")


def test_free_requests_in_a_mixed_batch_equal_a_plain_run(llm: LLM) -> None:
    prompts = random_prompts(10, 4, 30, vocab=700, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    mixed_prompts, mixed_params = [], []
    for i, p in enumerate(prompts):
        mixed_prompts += [{"prompt_token_ids": p}, {"prompt_token_ids": p}]
        kind, spec = KINDS[i % len(KINDS)]
        mixed_params += [greedy, sampled(kind, spec, n=1)[0]]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    for a, b in zip(plain, mixed[0::2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_all_blocks_free(llm)


def _greedy_constrained(tiny_llama: str, **engine_kw: Any) -> tuple[list[list[int]], dict]:
    prefixes = random_prompts(3, 40, 60, vocab=700, seed=10)   # shared: prefix cache hits
    prompts = [{"prompt_token_ids": prefixes[i % 3] + tail}
               for i, tail in enumerate(random_prompts(12, 1, 60, vocab=700, seed=11))]
    params = [SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=SO(**{k: s})) for k, s in KINDS] * 3
    llm = LLM(tiny_llama, **{**ENGINE, **engine_kw}, multiprocessing=False)
    try:
        outs = llm.generate(prompts, params[:len(prompts)], use_tqdm=False)
        assert_all_blocks_free(llm)
        for out, (k, s) in zip(outs, (KINDS * 3)[:len(prompts)]):
            if out.outputs[0].finish_reason == "stop":
                assert check_output(k, s, out.outputs[0].text), (k, out.outputs[0].text)
        return [o.outputs[0].token_ids for o in outs], llm.get_stats()
    finally:
        llm.shutdown()


def test_constrained_under_chunked_prefill_prefix_caching_and_preemption(tiny_llama: str) -> None:
    plain, _ = _greedy_constrained(tiny_llama, enable_prefix_caching=False,
                                   enable_chunked_prefill=False)
    chunked, chunked_stats = _greedy_constrained(tiny_llama, enable_prefix_caching=True,
                                                 max_num_batched_tokens=32)
    preempted, preempted_stats = _greedy_constrained(tiny_llama, num_gpu_blocks_override=33,
                                                     enable_prefix_caching=False)
    assert chunked == plain
    assert preempted == plain
    assert preempted_stats["num_preemptions"] > 0
    assert chunked_stats["prefix_cache_hits"] > 0
    # Jump-forward under all three at once: valid outputs (checked inside), no block leaked.
    _greedy_constrained(tiny_llama, num_gpu_blocks_override=33, max_num_batched_tokens=32,
                        structured_outputs_config={"enable_jump_forward": True})


LONG_KEYS = {"type": "object", "additionalProperties": False,
             "properties": {f"a_rather_long_key_name_{i}": {"enum": ["x", "y"]} for i in range(4)}}
LONG_KEYS["required"] = list(LONG_KEYS["properties"])


def _steps_and_outputs(tiny_llama: str, jump_forward: bool) -> tuple[int, list[str]]:
    llm = LLM(tiny_llama, **ENGINE, multiprocessing=False,
              structured_outputs_config={"enable_jump_forward": jump_forward})
    try:
        engine, steps, texts = llm.llm_engine, 0, {}
        for i in range(4):
            engine.add_request(str(i), {"prompt_token_ids": [5 + i, 9, 300]}, SamplingParams(
                temperature=1.0, seed=i, max_tokens=200,
                structured_outputs=SO(json=LONG_KEYS, disable_any_whitespace=True)))
        core = engine.engine_core.engine_core
        batch = core.model_executor.worker.model_runner.input_batch
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    texts[out.request_id] = out.outputs[0].text
            # The workers hold every token the engine core appended, jump-forward ones too
            # (after the step that ships them: tokens still pending are not counted).
            for req in core.scheduler.running:
                row = batch.req_id_to_index[req.request_id]
                pending = req.num_tokens - core.scheduler._worker_num_tokens[req.request_id]
                n = int(batch.num_tokens[row])
                assert n + pending == req.num_tokens, (n, pending, req.num_tokens)
                assert batch.token_ids[row, :n].tolist() == req.all_token_ids[:n]
        assert_all_blocks_free(llm)
        return steps, [texts[str(i)] for i in range(4)]
    finally:
        llm.shutdown()


def test_jump_forward_appends_forced_tokens_without_model_steps(tiny_llama: str) -> None:
    steps_off, texts_off = _steps_and_outputs(tiny_llama, False)
    steps_on, texts_on = _steps_and_outputs(tiny_llama, True)
    for text in texts_off + texts_on:
        assert check_output("json", LONG_KEYS, text), text
    # Each fixed key is ~7 tokens the model no longer decodes one by one.
    assert steps_on < steps_off / 2, (steps_on, steps_off)


def test_abort_while_compiling_frees_everything_and_others_proceed(llm: LLM) -> None:
    """A slow grammar (a schema with many required properties) compiles while a free request
    runs to its end; aborting the waiting request then frees it without a trace."""
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    big = {"type": "object", "required": [f"key_{i}" for i in range(1500)],
           "properties": {f"key_{i}": {"type": "string", "pattern": "[a-z]{2,9}"}
                          for i in range(1500)}}
    engine.add_request("slow", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=8, structured_outputs=SO(json=big)))
    engine.add_request("free", {"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    done = []
    while not done:
        done = [o for o in engine.step() if o.finished and o.request_id == "free"]
    slow = core.scheduler.requests["slow"]
    assert slow.status == RequestStatus.WAITING_FOR_FSM   # still compiling
    engine.abort_request(["slow"])
    assert "slow" not in core.scheduler.requests and not core.scheduler.num_waiting_reqs
    assert not engine.has_unfinished_requests()
    assert core.structured_output_manager.num_active == 0
    assert_all_blocks_free(llm)
    # The engine keeps serving constrained requests.
    out = llm.generate(["again"], sampled("regex", REGEX, n=1, max_tokens=20), use_tqdm=False)
    assert out[0].outputs[0].finish_reason in ("stop", "length")


BAD = [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "json"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="([a-z]"), "regex"),
    (dict(grammar='root ::= "a" |'), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(regex="a+", choice=["a"]), "exactly one"),
    (dict(), "exactly one"),
]


@pytest.mark.parametrize("kw,words", BAD, ids=[w for _, w in BAD])
def test_bad_constraints_are_value_errors_before_scheduling(llm: LLM, kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        llm.generate(["hi"], SamplingParams(max_tokens=4, structured_outputs=SO(**kw)),
                     use_tqdm=False)
    assert_all_blocks_free(llm)


def test_guidance_backend_is_a_clear_error(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, **ENGINE, multiprocessing=False,
              structured_outputs_config={"backend": "guidance"})
    try:
        with pytest.raises(ValueError, match="guidance"):
            llm.generate(["hi"], sampled("regex", REGEX, n=1), use_tqdm=False)
        out = llm.generate(["hi"], SamplingParams(max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="backend"):
        LLM(tiny_llama, **ENGINE, structured_outputs_config='{"backend": "outlines"}')


def test_masked_sampling_keeps_the_model_distribution(llm: LLM) -> None:
    """Sampling under a constraint draws from the model's distribution renormalised over the
    allowed tokens (chi-square against a plain run's full-vocabulary logprobs)."""
    tok = llm.get_tokenizer()
    letters = "abcde"
    ids = [tok.encode(c, add_special_tokens=False) for c in letters]
    assert all(len(i) == 1 for i in ids)
    prompt = {"prompt_token_ids": [5, 77, 301, 42]}
    plain = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=1, logprobs=-1),
                         use_tqdm=False)[0].outputs[0].logprobs[0]
    probs = torch.tensor([math.exp(plain[i[0]].logprob) for i in ids], dtype=torch.float64)
    probs /= probs.sum()
    n = 400
    outs = llm.generate([prompt] * n, [SamplingParams(
        temperature=1.0, seed=s, max_tokens=1, structured_outputs=SO(regex="[a-e]"))
        for s in range(n)], use_tqdm=False)
    counts = torch.zeros(len(letters), dtype=torch.float64)
    for o in outs:
        counts[letters.index(o.outputs[0].text)] += 1
    expected = probs * n
    big = expected >= 5                    # merge the rare bins so the test is valid
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    chi2 = float((((obs - exp) ** 2) / exp)[keep].sum())
    # df <= 4; 18.47 is the 0.001 critical value for df = 4.
    assert chi2 < 18.47, (chi2, counts.tolist(), expected.tolist())
