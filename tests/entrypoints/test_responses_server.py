"""`/v1/responses` through a real `kvserve serve` and the official client's `responses` API:
text whole and streamed (the same seed gives the same text, the events in OpenAI's order),
function tools (a named tool_choice forces the call; its arguments stream in pieces),
`previous_response_id` continuing a stored conversation, retrieval, the store's bound, and
bad input as 400 / 404."""
from __future__ import annotations

import json
from typing import Any, Iterator

import jsonschema
import openai
import pytest

from kvserve.entrypoints.openai import serving_responses
from kvserve.entrypoints.openai.protocol import ResponsesRequest
from kvserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer
from tests.entrypoints.test_reasoning_and_tools_e2e import STARTUP_TIMEOUT_S

pytestmark = pytest.mark.timeout(1500)

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": WEATHER_PARAMS}


@pytest.fixture(scope="module")
def server(tiny_llama: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llama, [
        *SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning",
        "--structured-outputs-config", '{"disable_any_whitespace": true}'],
        startup_timeout=STARTUP_TIMEOUT_S)
    try:
        yield srv
    finally:
        srv.close()


def _events(stream: Any) -> list[Any]:
    return list(stream)


def test_text_whole_and_streamed(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, input="Tell me a story.", instructions="Be brief.",
              max_output_tokens=12, temperature=1.0, extra_body={"seed": 3})
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens == 12 and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"

    events = _events(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert events[-4].text == text


def test_function_call_whole_and_streamed(client: openai.OpenAI, model_name: str) -> None:
    done = 0
    for seed in range(4):
        kw = dict(model=model_name, input="Weather in Paris?", tools=[WEATHER],
                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                  temperature=1.0, extra_body={"seed": seed})
        r = client.responses.create(**kw)
        if r.status != "completed":
            continue
        done += 1
        [call] = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)

        events = _events(client.responses.create(stream=True, **kw))
        added = [e for e in events if e.type == "response.output_item.added"]
        assert len(added) == 1 and added[0].item.name == "get_weather"
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) >= 2 and "".join(deltas) == call.arguments
        [args_done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert args_done.arguments == call.arguments
        assert events[-1].response.output[0].arguments == call.arguments
    assert done >= 2


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI,
                                                          model_name: str) -> None:
    first = client.responses.create(model=model_name, input="Hello there.", max_output_tokens=8)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    second = client.responses.create(model=model_name, input="And then?", max_output_tokens=8,
                                     previous_response_id=first.id)
    alone = client.responses.create(model=model_name, input="And then?", max_output_tokens=8)
    # The earlier turn (its input and its answer) is in the second prompt.
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id

    unstored = client.responses.create(model=model_name, input="x", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=model_name, input="x", previous_response_id="resp_nope")


@pytest.mark.parametrize("kw,words", [
    ({"input": []}, "input must not be empty"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": [{"type": "message", "role": "user",
                 "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ({"input": "x", "tool_choice": "required"}, "tools"),
])
def test_bad_input_is_400(client: openai.OpenAI, model_name: str, kw: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError, match=words):
        client.responses.create(model=model_name, max_output_tokens=2, **kw)


def test_the_store_keeps_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving_responses, "MAX_STORED_RESPONSES", 3)
    handler = OpenAIServingResponses(chat=None)  # type: ignore[arg-type]
    request = ResponsesRequest(input="x")
    ids = []
    for i in range(5):
        body = handler._base(request, f"resp_{i}", "m")
        handler._finish(request, body, [], [], "stop", 1, 1)
        ids.append(body["id"])
    assert list(handler.store) == ids[2:]
    with pytest.raises(Exception, match="not found"):
        handler.retrieve(ids[0])


def test_stream_events_for_reasoning_text_and_a_call() -> None:
    """The event order when one stream holds all three kinds of output item."""
    from kvserve.entrypoints.openai.protocol import DeltaMessage
    from kvserve.entrypoints.openai.serving_responses import _EventWriter

    writer = _EventWriter({})
    chunks = [DeltaMessage(reasoning_content="a"), DeltaMessage(reasoning_content="b", content="c"),
              DeltaMessage(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "f", "arguments": "{"}}]),
              DeltaMessage(tool_calls=[{"index": 0, "function": {"arguments": "}"}}])]
    raw = [e for d in chunks for e in writer.deltas(d)] + writer.close_item()
    events = [json.loads(e.split("data: ", 1)[1]) for e in raw]
    assert [e["type"].removeprefix("response.") for e in events] == [
        "output_item.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done"]
    assert all(e.startswith(f"event: {v['type']}\n") for e, v in zip(raw, events))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert [(i["type"], i["status"]) for i in writer.items] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")]
    assert writer.items[0]["content"][0]["text"] == "ab"
    assert writer.items[1]["content"][0]["text"] == "c"
    assert (writer.items[2]["name"], writer.items[2]["arguments"], writer.items[2]["call_id"]) == (
        "f", "{}", "call_1")
