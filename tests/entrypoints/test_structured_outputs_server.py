"""Structured outputs and tool calls through a real `kvserve serve` and the official client."""
from __future__ import annotations

import re
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer
from tests.structured_output.conftest import (CHOICES, EBNF, PERSON_SCHEMA, REGEX, check_output,
                                              load_json)

pytestmark = pytest.mark.timeout(400)

MESSAGES = [{"role": "user", "content": "Tell me about someone."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Forces the model's text into the hermes format, so that "auto" has a call to parse.
HERMES_REGEX = (r'[a-z]{1,4} <tool_call>\{"name": "get_weather", "arguments": '
                r'\{"city": "[a-z]{1,6}", "unit": "c"\}\}</tool_call>')


@pytest.fixture(scope="module")
def server(tiny_llama: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llama, [
        *SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning",
        "--structured-outputs-config", '{"disable_any_whitespace": true}',
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], startup_timeout=300)
    try:
        yield srv
    finally:
        srv.close()


def _chat(client: openai.OpenAI, model_name: str, seed: int, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=1.0,
                                          seed=seed, **kw)


def test_chat_response_format_json_schema_and_json_object(client: openai.OpenAI, model_name: str) -> None:
    finished = 0
    for seed in range(6):
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
        choice = _chat(client, model_name, seed, response_format=fmt).choices[0]
        if choice.finish_reason == "stop":
            finished += 1
            jsonschema.validate(load_json(choice.message.content), PERSON_SCHEMA)
        obj = _chat(client, model_name, seed, response_format={"type": "json_object"}).choices[0]
        if obj.finish_reason == "stop":
            assert isinstance(load_json(obj.message.content), dict)
    assert finished >= 2


@pytest.mark.parametrize("kind,spec", [("regex", REGEX), ("choice", CHOICES), ("grammar", EBNF),
                                       ("json", PERSON_SCHEMA)])
def test_completions_structured_outputs_extra_body(client: openai.OpenAI, model_name: str,
                                                   kind: str, spec: Any) -> None:
    finished = 0
    for seed in range(6):
        c = client.completions.create(model=model_name, prompt="Answer:", temperature=1.0, seed=seed,
                                      max_tokens=60, extra_body={"structured_outputs": {kind: spec}}
                                      ).choices[0]
        if c.finish_reason == "stop":
            finished += 1
            assert check_output(kind, spec, c.text), c.text
    assert finished >= 2


def test_streaming_is_valid_too(client: openai.OpenAI, model_name: str) -> None:
    for seed in range(3):
        stream = client.chat.completions.create(
            model=model_name, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=40, stream=True,
            extra_body={"structured_outputs": {"choice": CHOICES}})
        text, finish = "", None
        for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        assert finish == "stop" and text in CHOICES, (text, finish)
        stream = client.completions.create(model=model_name, prompt="x", temperature=1.0, seed=seed,
                                           max_tokens=20, stream=True,
                                           extra_body={"structured_outputs": {"regex": REGEX}})
        text = "".join(ch.text for chunk in stream for ch in chunk.choices)
        assert re.fullmatch(REGEX, text), text


def _check_call(call: Any) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(load_json(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_required_and_named(client: openai.OpenAI, model_name: str) -> None:
    got_required = 0
    for seed in range(4):
        r = _chat(client, model_name, seed, tools=TOOLS, tool_choice="required").choices[0]
        if r.finish_reason == "tool_calls":
            got_required += 1
            assert r.message.tool_calls and r.message.content is None
            for call in r.message.tool_calls:
                _check_call(call)
        named = {"type": "function", "function": {"name": "get_time"}}
        n = _chat(client, model_name, seed, tools=TOOLS, tool_choice=named).choices[0]
        if n.finish_reason == "stop":
            assert [c.function.name for c in n.message.tool_calls] == ["get_time"]
            _check_call(n.message.tool_calls[0])
    assert got_required >= 1


def test_tool_choice_auto_hermes_whole_and_streamed(client: openai.OpenAI, model_name: str) -> None:
    extra = {"structured_outputs": {"regex": HERMES_REGEX}}
    r = _chat(client, model_name, 0, tools=TOOLS, tool_choice="auto", max_tokens=120,
              extra_body=extra).choices[0]
    assert r.finish_reason == "tool_calls", r
    assert re.fullmatch("[a-z]{1,4}", r.message.content)
    [call] = r.message.tool_calls
    assert call.function.name == "get_weather"
    _check_call(call)

    stream = client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=1.0, seed=0, max_tokens=120, stream=True,
        tools=TOOLS, tool_choice="auto", extra_body=extra)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert content.strip() == r.message.content     # same seed, same text
    assert list(calls.values()) == [{"name": "get_weather",
                                     "arguments": call.function.arguments}]

    # Named calls stream their arguments piece by piece.
    stream = client.chat.completions.create(
        model=model_name, messages=MESSAGES, temperature=1.0, seed=1, max_tokens=80, stream=True,
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args, name = "", ""
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
    assert name == "get_weather"
    if args.endswith("}"):
        jsonschema.validate(load_json(args), PARAMS["get_weather"])


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}}, "json"),
    ({"extra_body": {"structured_outputs": {"regex": "(["}}}, "regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}}, "grammar"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "choice"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "exactly one"),
    ({"extra_body": {"structured_outputs": {"regexp": "a"}}}, "regexp"),
    ({"response_format": {"type": "json_object"},
      "extra_body": {"structured_outputs": {"regex": "a"}}}, "not both"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize("kw,words", BAD_REQUESTS, ids=[w for _, w in BAD_REQUESTS])
def test_bad_input_is_400_and_the_server_keeps_serving(client: openai.OpenAI, model_name: str,
                                                       kw: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, **kw)
    assert words in str(e.value), str(e.value)
    ok = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
