"""Grammar-constrained requests with speculation: their drafts are checked position by position
by the request's matcher (one bitmask row per draft + the bonus row, the matcher rolled back
and advanced by the accepted tokens), so outputs equal the plain constrained run's and stay
valid, with drafts accepted, alone and beside unconstrained drafting requests."""
from __future__ import annotations

import re
from typing import Iterator

import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams as SO
from tests.spec_decode.conftest import BASE, GREEDY, prompts
from tests.spec_decode.test_spec_decode import NGRAM, assert_all_blocks_free
from tests.structured_output.conftest import is_valid_json
from tests.utils import assert_same_outputs

# Outputs a random model repeats itself in: n-gram drafts get accepted.
WORDS = r"((red|green|blue) ){12}"
LIST_SCHEMA = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
               "minItems": 8, "maxItems": 8}
TEXTS = ["red green blue red green blue red green", "alpha beta gamma", "the colors are",
         '["beta", "beta", "gamma"', "blue blue", "list:"]


def constrained(kind: str) -> SamplingParams:
    so = SO(regex=WORDS) if kind == "regex" else SO(json=LIST_SCHEMA, disable_any_whitespace=True)
    return SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=so)


def is_valid(kind: str, text: str) -> bool:
    return (re.fullmatch(WORDS, text) is not None if kind == "regex"
            else is_valid_json(text, LIST_SCHEMA))


@pytest.fixture(scope="module")
def engines(tiny_llama: str) -> Iterator[tuple[LLM, LLM]]:
    plain = LLM(tiny_llama, **BASE)
    spec = LLM(tiny_llama, **BASE, speculative_config=NGRAM)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def _accepted(llm: LLM) -> int:
    return llm.get_stats()["spec_decoding"]["num_accepted_tokens"]


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_constrained_ngram_greedy_identical(engines: tuple[LLM, LLM], kind: str) -> None:
    plain, spec = engines
    params = constrained(kind)
    before = _accepted(spec)
    a = plain.generate(TEXTS, params, use_tqdm=False)
    b = spec.generate(TEXTS, params, use_tqdm=False)
    assert_same_outputs(a, b, f"constrained ({kind}) + n-gram")
    assert _accepted(spec) - before >= 40, "constrained requests' drafts were not accepted"
    for out in b:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        assert is_valid(kind, out.outputs[0].text), out.outputs[0].text
    assert_all_blocks_free(spec)


def test_mixed_batch_and_sampling(engines: tuple[LLM, LLM]) -> None:
    """Constrained (regex, json) and unconstrained requests in one batch, all drafting: greedy
    identical to the plain run; seeded constrained sampling with drafts stays valid."""
    plain, spec = engines
    ps = TEXTS + prompts()[::2]
    kinds = ["regex", "json", None]
    params = [constrained(kinds[i % 3]) if kinds[i % 3] else GREEDY for i in range(len(ps))]
    a = plain.generate(ps, params, use_tqdm=False)
    b = spec.generate(ps, params, use_tqdm=False)
    assert_same_outputs(a, b, "mixed constrained / unconstrained + n-gram")
    for i, out in enumerate(b):
        if kinds[i % 3]:
            assert is_valid(kinds[i % 3], out.outputs[0].text), out.outputs[0].text
    sampled = [SamplingParams(temperature=1.0, max_tokens=80, seed=i,
                              structured_outputs=constrained(kinds[i % 2]).structured_outputs)
               for i in range(len(TEXTS))]
    for i, out in enumerate(spec.generate(TEXTS, sampled, use_tqdm=False)):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        assert is_valid(kinds[i % 2], out.outputs[0].text), out.outputs[0].text
    assert_all_blocks_free(spec)
