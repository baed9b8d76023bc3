"""Reasoning and tool-call parsing end to end.

- Offline, the engine's reasoning gate: a constrained request whose grammar waits for a
  reasoning-end token generates exactly the unconstrained tokens up to and including that
  token, and grammar-valid tokens after it.
- Through a real `kvserve serve --reasoning-parser deepseek_r1 --tool-call-parser hermes` and
  the official client: a random tiny model does not reason or call tools on its own, so a
  logit bias makes it write `</think>` soon, and a structured-outputs regex (enforced only after
  the reasoning, which is what is under test) makes it write a hermes call. What this proves:
  the grammar is not applied to the reasoning and is applied after it; reasoning_content,
  content and tool calls come out of the server separated, the same in a stream as in a whole
  response (same seed); a streamed call's first delta names it and its arguments arrive in
  several deltas. What it does not prove: that a real reasoning model's text parses (the
  recorded-output tests in test_parsers.py cover the formats).
- A reasoning parser for a model whose tokenizer has no <think> / </think> is an error at start.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Iterator

import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer
from tests.utils import random_prompts

# Under load a server's first start (kernels compiled for the session) takes minutes.
pytestmark = pytest.mark.timeout(1500)
STARTUP_TIMEOUT_S = 1200

REGEX = r"[a-f]{2,4}-\d{1,3}"
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, seed=0)


# ---------------------------------------------------------------------- engine gate (offline)
def test_grammar_waits_for_the_reasoning_end_token(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, **ENGINE, multiprocessing=False)
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 5, 30, vocab=700, seed=5)]
        free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
        params, ends = [], []
        for tokens in plain:
            # The reasoning "ends" at the first token from position 3 on not seen before it.
            k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
            ends.append(k)
            params.append(SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
                StructuredOutputsParams(regex=REGEX, reasoning_end_token_id=tokens[k]))))
        outs = llm.generate(prompts, params, use_tqdm=False)
        for tokens, k, out in zip(plain, ends, outs):
            got = out.outputs[0].token_ids
            assert got[:k + 1] == tokens[:k + 1], "the grammar constrained the reasoning"
            after = tokenizer.decode(got[k + 1:], skip_special_tokens=True)
            assert out.outputs[0].finish_reason == "stop" and re.fullmatch(REGEX, after), after
        stats = llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def think_model(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """tiny_llama with <think> and </think> added to its tokenizer (the model's 1024-entry
    vocabulary has room for them), as DeepSeek-R1's and Qwen3's tokenizers have them; and the
    id of </think>."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    path = str(tmp_path_factory.mktemp("think_model"))
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    tok = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(os.path.join(path, "tokenizer.json"))
    end_id = tok.token_to_id("</think>")
    assert end_id < 1024
    return path, end_id


@pytest.fixture(scope="module")
def server(think_model: tuple[str, int]) -> Iterator[RemoteServer]:
    srv = RemoteServer(think_model[0], [
        *SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning",
        "--structured-outputs-config", '{"disable_any_whitespace": true}',
        "--reasoning-parser", "deepseek_r1",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        startup_timeout=STARTUP_TIMEOUT_S)
    try:
        yield srv
    finally:
        srv.close()


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": '
               r'\{"city": "[a-z]{3,6}"\}\}</tool_call>')


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[str, str, list[Any], Any]:
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            delta = ch.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = ch.finish_reason or finish
    return reasoning, content, calls, finish


def _bias(think_model: tuple[str, int]) -> dict[str, float]:
    return {str(think_model[1]): 6.0}     # </think> likely within a few tokens, not at once


def test_reasoning_is_free_and_the_grammar_follows_it(client: openai.OpenAI, model_name: str,
                                                      think_model: tuple[str, int]) -> None:
    reasoned = 0
    for seed in range(6):
        kw = dict(model=model_name, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=60,
                  logit_bias=_bias(think_model), extra_body={"structured_outputs": {"regex": REGEX}})
        choice = client.chat.completions.create(**kw).choices[0]
        message = choice.message
        reasoning = getattr(message, "reasoning_content", None)
        if choice.finish_reason == "stop" and message.content is not None:
            assert re.fullmatch(REGEX, message.content), message.content
            if reasoning and not re.fullmatch(REGEX, reasoning):
                reasoned += 1          # free text first, then the grammar
        assert _stream(client, **kw) == (reasoning or "", message.content or "", [],
                                         choice.finish_reason)
    assert reasoned >= 2


def test_reasoning_then_a_streamed_tool_call(client: openai.OpenAI, model_name: str,
                                             think_model: tuple[str, int]) -> None:
    found = 0
    for seed in range(6):
        kw = dict(model=model_name, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=80,
                  tools=[WEATHER], tool_choice="auto", logit_bias=_bias(think_model),
                  extra_body={"structured_outputs": {"regex": HERMES_CALL}})
        choice = client.chat.completions.create(**kw).choices[0]
        if choice.finish_reason != "tool_calls":
            continue                  # EOS inside the reasoning: nothing to check
        found += 1
        message = choice.message
        [call] = message.tool_calls
        assert call.function.name == "get_weather" and call.id and message.content is None
        assert re.fullmatch(r"[a-z]{3,6}", json.loads(call.function.arguments)["city"])
        reasoning, content, deltas, finish = _stream(client, **kw)
        assert (reasoning or None, content, finish) == (
            getattr(message, "reasoning_content", None), "", "tool_calls")
        assert deltas[0].function.name == "get_weather" and deltas[0].id and deltas[0].type
        assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
        assert len(deltas) >= 3, "the arguments came in one piece"
    assert found >= 2


def test_reasoning_parser_without_think_tokens_fails_at_start(tiny_llama: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", tiny_llama, "--port", "0",
         *SERVER_ENGINE_ARGS, "--reasoning-parser", "qwen3"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--reasoning-parser qwen3: the model's tokenizer has no <think> and no </think>" \
        in proc.stderr, proc.stderr[-3000:]
