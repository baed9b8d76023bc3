"""Structured outputs are valid by construction: every JSON-schema and json_object answer that
ends by the grammar parses with a strict JSON parser (`json.loads`: no raw control characters
in strings) and validates against its schema, sampled (temperature 1, many seeds) and greedy,
on the random tiny model and the real demo model. `disable_any_whitespace` writes no
whitespace outside strings. min_tokens beyond what the grammar allows is a clear error, not a
hang or a made-up token; a grammar that does not compile in time fails its request alone."""
from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams as SO
from tests.structured_output.conftest import ENGINE, PERSON_SCHEMA, json_skeleton
from tests.utils import random_prompts

# Bounded strings (minLength / maxLength) are where xgrammar's own rule admitted raw control
# characters; free strings, enums, nesting and arrays beside them.
STRINGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "minLength": 1, "maxLength": 8},
        "b": {"type": "string", "maxLength": 5},
        "c": {"type": "string"},
        "d": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
SCHEMAS = [STRINGS_SCHEMA, PERSON_SCHEMA]
NUM_SEEDS = 48


def _params(temperature: float, n: int, max_tokens: int = 40) -> tuple[list, list]:
    params, specs = [], []
    for spec in [*SCHEMAS, None]:                  # None: json_object
        so = SO(json=spec, disable_any_whitespace=True) if spec is not None else SO(
            json_object=True, disable_any_whitespace=True)
        for seed in range(n):
            params.append(SamplingParams(temperature=temperature, seed=seed,
                                         max_tokens=max_tokens, structured_outputs=so))
            specs.append(spec)
    return params, specs


def _check_all(outs: list, specs: list) -> int:
    """Every output the grammar ended parses strictly and validates; returns how many."""
    finished = 0
    for out, spec in zip(outs, specs):
        c = out.outputs[0]
        if c.finish_reason != "stop":      # cut by max_tokens: incomplete by design
            continue
        finished += 1
        value = json.loads(c.text)          # strict: raises on a raw control character
        if spec is None:
            assert isinstance(value, dict), c.text
        else:
            jsonschema.validate(value, spec)
    return finished


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    llm = LLM(tiny_llama, **ENGINE, multiprocessing=False)
    yield llm
    llm.shutdown()


def test_bounded_strings_refuse_control_characters() -> None:
    """The compiled grammar itself: a raw control character in a bounded string is refused,
    its escape-free text accepted, for every whitespace setting."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.structured_output.backend_xgrammar import json_schema_grammar

    for any_ws in (True, False):
        g = json_schema_grammar(xgr, json.dumps(STRINGS_SCHEMA), any_ws)
        good = '{"a":"x","b":"","c":"y"}'
        assert accepts(g, good if not any_ws else good.replace(",", ", "))
        for ctrl in ("\x00", "\x01", "\t", "\x1b", "\x1f"):
            assert not accepts(g, good.replace('"x"', f'"x{ctrl}"')), (any_ws, repr(ctrl))
            assert not accepts(g, good.replace('"y"', f'"y{ctrl}"')), (any_ws, repr(ctrl))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_every_json_answer_parses_strictly_on_the_random_model(llm: LLM,
                                                               temperature: float) -> None:
    n = NUM_SEEDS if temperature else 1
    params, specs = _params(temperature, n)
    prompts = random_prompts(len(params), 3, 20, vocab=700, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finished = _check_all(outs, specs)
    assert finished >= len(outs) // 3, f"only {finished} of {len(outs)} finished"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_every_json_answer_parses_strictly_on_the_demo_model(smollm2_gguf: str,
                                                             temperature: float) -> None:
    llm = LLM(smollm2_gguf, max_model_len=512, kv_cache_memory=32 << 20, seed=0,
              multiprocessing=False)
    try:
        n = 8 if temperature else 1      # 3 constraints x 8 seeds, batched
        params, specs = _params(temperature, n, max_tokens=48)
        prompt = ("<|im_start|>user\nReply with a JSON object describing a person.<|im_end|>\n"
                  "<|im_start|>assistant\n")
        outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        finished = _check_all(outs, specs)
        assert finished >= len(outs) // 3, f"only {finished} of {len(outs)} finished"
    finally:
        llm.shutdown()


def test_disable_any_whitespace_writes_no_whitespace(llm: LLM) -> None:
    params, _ = _params(1.0, 24)
    prompts = random_prompts(len(params), 3, 20, vocab=700, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    checked = 0
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            checked += 1
            skeleton = json_skeleton(out.outputs[0].text)     # strings out of the way
            assert not re.search(r"\s", skeleton), out.outputs[0].text
    assert checked >= 10


def test_min_tokens_past_the_grammar_is_a_clear_error(llm: LLM) -> None:
    """The grammar can only end after "ab" but min_tokens forbids ending: the request ends at
    once with finish_reason "error" and a message naming both, greedy and sampled; a free
    request in the same batch is untouched."""
    t0 = time.monotonic()
    params = [SamplingParams(max_tokens=30, min_tokens=10, temperature=t, seed=1,
                             structured_outputs=SO(**kw))
              for kw in ({"regex": "ab"}, {"choice": ["yes", "no"]},
                         {"json": {"type": "integer", "minimum": 0, "maximum": 9}})
              for t in (0.0, 1.0)]
    free = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * (len(params) + 1), [*params, free],
                        use_tqdm=False)
    for out in outs[:-1]:
        c = out.outputs[0]
        assert c.finish_reason == "error", (c.text, c.finish_reason)
        assert "min_tokens=10" in str(c.stop_reason), c.stop_reason
    assert len(outs[-1].outputs[0].token_ids) == 12
    assert time.monotonic() - t0 < 60


def test_a_grammar_over_the_compile_time_limit_fails_alone(tiny_llama: str) -> None:
    """With a limit far below any compile, the constrained request fails with the limit named;
    a free request beside it completes."""
    llm = LLM(tiny_llama, **ENGINE, multiprocessing=False,
              structured_outputs_config='{"grammar_compile_timeout_s": 1e-6}')
    try:
        schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 9}
                                                   for i in range(120)}}
        outs = llm.generate(
            [{"prompt_token_ids": [5, 6, 7]}] * 2,
            [SamplingParams(max_tokens=8, structured_outputs=SO(json=schema)),
             SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)], use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error"
        assert "grammar_compile_timeout_s" in str(outs[0].outputs[0].stop_reason)
        assert len(outs[1].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()
