"""Tool-call and reasoning parsers against recorded model outputs, whole and streamed with the
delta boundaries moved through every position of the text.

For each output: the non-streamed parse equals the recorded calls / content / reasoning; and
every stream of it (two deltas cut at each index, one delta per character, token-sized
deltas) concatenates to exactly the non-streamed content and arguments, names each call once
in its first delta (with id and type), and sends the arguments of a long call in several
pieces (incremental, not whole)."""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, Callable, Optional

import pytest

from kvserve.entrypoints.openai.reasoning_parsers import ReasoningStreamer, get_reasoning_parser
from kvserve.entrypoints.openai.serving_chat import ChoiceParser
from kvserve.entrypoints.openai.tool_parsers import (RequiredToolParser, ToolCallStreamer,
                                                     ToolParser, collect_calls, get_tool_parser,
                                                     tool_parser_names)
from kvserve.tokenizer import Tokenizer

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "filters": {"type": "object"},
                                         "strict": {"type": "boolean"},
                                         "score": {"type": "number"}}}}},
]

# parser -> [(model output, expected content, expected [(name, arguments)])]
RECORDED: dict[str, list[tuple[str, Optional[str], list[tuple[str, dict]]]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
         '\n</tool_call>', None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ('I\'ll check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
         '"Paris"}}\n</tool_call>\n<tool_call>\n{"arguments": {"city": "Tokyo, \\"JP\\"", '
         '"note": "a < b </tool"}, "name": "get_weather"}\n</tool_call>',
         "I'll check both cities.",
         [("get_weather", {"city": "Paris"}),
          ("get_weather", {"city": 'Tokyo, "JP"', "note": "a < b </tool"})]),
        ("The weather in Paris is sunny <b>today</b>.", "The weather in Paris is sunny "
         "<b>today</b>.", []),
        ("<tool_call>not json</tool_call> so no call", "<tool_call>not json</tool_call> so no "
         "call", []),
    ],
    "llama3_json": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}',
         None, [("get_weather", {"city": "Paris", "days": [1, 2]})]),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "search", '
         '"parameters": {"query": "{not a brace}"}}', None,
         [("get_weather", {"city": "Paris"}), ("search", {"query": "{not a brace}"})]),
        ("Paris is sunny today.", "Paris is sunny today.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
         '{"name": "search", "arguments": {}}]', None,
         [("get_weather", {"city": "Paris", "unit": "c"}), ("search", {})]),
        ('Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome [IT]"}}]',
         "Let me look.", [("get_weather", {"city": "Rome [IT]"})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]search[ARGS]'
         '{"query": "a]b"}', None, [("get_weather", {"city": "Paris", "days": 3}),
                                   ("search", {"query": "a]b"})]),
        ("No tools needed [really].", "No tools needed [really].", []),
    ],
    "pythonic": [
        ("[get_weather(city='Paris', unit=\"celsius\"), search(query='Europe/Paris')]", None,
         [("get_weather", {"city": "Paris", "unit": "celsius"}),
          ("search", {"query": "Europe/Paris"})]),
        ("[search(query='a, b (c)', filters={'year': 2024, 'tags': ['x', \"y)\"]}, strict=True, "
         "score=None)]", None,
         [("search", {"query": "a, b (c)", "filters": {"year": 2024, "tags": ["x", "y)"]},
                      "strict": True, "score": None})]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("Sure! Here you go.", "Sure! Here you go.", []),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None,
         [("get_weather", {"city": "Paris", "days": 3})]),
        ("Let me check.\n<tool_call>\n<function=search>\n<parameter=query>\nbest <b>pizza</b>\n"
         "in town\n</parameter>\n<parameter=filters>\n{\"open\": true}\n</parameter>\n"
         "<parameter=strict>\nfalse\n</parameter>\n<parameter=score>\n4.5\n</parameter>\n"
         "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>",
         "Let me check.",
         [("search", {"query": "best <b>pizza</b>\nin town", "filters": {"open": True},
                      "strict": False, "score": 4.5, "extra": "7"})]),
        ("Just text < with a bracket.", "Just text < with a bracket.", []),
    ],
}
CASES = [(name, i) for name, outputs in RECORDED.items() for i in range(len(outputs))]


# ---------------------------------------------------------------------- how text is cut
def cuts(text: str, seeds: int = 6) -> list[list[str]]:
    """Delta lists for one text: two deltas at every index, one per character, and
    token-sized deltas (1-6 characters) from a few seeds."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    for seed in range(seeds):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def run_stream(make: Callable[[], ToolParser], pieces: list[str], max_calls: Optional[int] = None
               ) -> tuple[str, list[dict[str, Any]]]:
    """Feed deltas as the server does (the last one with the finish); returns the content
    and every tool-call delta."""
    parser = make()
    streamer = ToolCallStreamer(parser.parse, parser.make_id, max_calls)
    content, deltas = "", []
    pieces = pieces or [""]
    for k, piece in enumerate(pieces):
        c, d = streamer.feed(piece, final=k == len(pieces) - 1)
        content += c
        deltas += d
    return content, deltas


def whole(make: Callable[[], ToolParser], text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    content, deltas = run_stream(make, [text])
    return content or None, collect_calls(deltas)


def check_stream_shape(deltas: list[dict[str, Any]], calls: list[dict[str, Any]]) -> None:
    """vLLM's shape: a call's first delta has id, type and name; later ones only arguments;
    arguments concatenate to the whole call's."""
    seen: dict[int, dict[str, Any]] = {}
    for d in deltas:
        i = d["index"]
        if i not in seen:
            assert i == len(seen), f"call {i} started before call {len(seen)}"
            assert d["type"] == "function" and d["id"] and d["function"]["name"], d
            seen[i] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            assert d["function"]["arguments"], "empty argument delta"
            seen[i]["arguments"] += d["function"]["arguments"]
    assert [seen[i] for i in sorted(seen)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


def maker(name: str) -> Callable[[], ToolParser]:
    cls = get_tool_parser(name)
    return lambda: cls(WEATHER_TOOLS)


# ---------------------------------------------------------------------- tool parsers
def test_every_vllm_parser_name_is_registered() -> None:
    assert set(RECORDED) <= set(tool_parser_names())


@pytest.mark.parametrize("name,i", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_tool_parser_whole_output(name: str, i: int) -> None:
    text, content, calls = RECORDED[name][i]
    got_content, got_calls = whole(maker(name), text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] \
        == calls
    assert len({c["id"] for c in got_calls}) == len(got_calls)
    if name == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in got_calls)


@pytest.mark.parametrize("name,i", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_tool_parser_streamed_at_every_cut_equals_whole(name: str, i: int) -> None:
    text = RECORDED[name][i][0]
    make = maker(name)
    content, calls = whole(make, text)
    for pieces in cuts(text):
        got_content, deltas = run_stream(make, pieces)
        assert (got_content or None) == content, pieces
        check_stream_shape(deltas, calls)


@pytest.mark.parametrize("name", list(RECORDED))
def test_arguments_stream_in_pieces(name: str) -> None:
    """One character per delta: the first call's arguments arrive in several deltas, the
    first of them with the name, before the call's text is complete."""
    text = RECORDED[name][0][0]
    _, deltas = run_stream(maker(name), list(text))
    first = [d for d in deltas if d["index"] == 0]
    assert len(first) >= 3, first
    assert "name" in first[0]["function"] and all("name" not in d["function"] for d in first[1:])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = RECORDED["hermes"][1][0]
    make = maker("hermes")
    for pieces in ([text], list(text)):
        content, deltas = run_stream(make, pieces, max_calls=1)
        assert content == "I'll check both cities."
        assert {d["index"] for d in deltas} == {0}
        assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}


def test_required_tool_choice_array_streams_incrementally() -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "search", "parameters": {"query": "x"}}]')
    content, calls = whole(RequiredToolParser, text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("search", {"query": "x"})]
    for pieces in cuts(text, seeds=2):
        _, deltas = run_stream(RequiredToolParser, pieces)
        check_stream_shape(deltas, calls)


def test_a_call_cut_off_by_max_tokens_keeps_what_was_written() -> None:
    """Streamed and whole agree on a truncated call too: the name and the arguments so far."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    content, calls = whole(maker("hermes"), text)
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Par')]
    for pieces in cuts(text, seeds=1):
        got, deltas = run_stream(maker("hermes"), pieces)
        assert got == "" and check_stream_shape(deltas, calls) is None


# ---------------------------------------------------------------------- reasoning parsers
@pytest.fixture(scope="module")
def think_tokenizer(demo_tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The demo tokenizer with <think> and </think> added as (non-special) tokens, as
    DeepSeek-R1's and Qwen3's tokenizers have them."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    path = str(tmp_path_factory.mktemp("think_tokenizer"))
    for f in os.listdir(demo_tokenizer_dir):
        shutil.copy(os.path.join(demo_tokenizer_dir, f), path)
    tok = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(os.path.join(path, "tokenizer.json"))
    return Tokenizer.from_pretrained(path)


# output -> (reasoning, content), the same for deepseek_r1 and qwen3
REASONING = [
    ("Okay, the user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "Okay, the user asks 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("<think>\nHmm, <b> and </thin are not markers\n</think>Answer: <think> stays.",
     "\nHmm, <b> and </thin are not markers\n", "Answer: <think> stays."),
    ("Still thinking, cut off by max_tokens </thi", "Still thinking, cut off by max_tokens </thi",
     ""),
]


def stream_reasoning(streamer: ReasoningStreamer, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    pieces = pieces or [""]
    for k, piece in enumerate(pieces):
        r, c = streamer.feed(piece, final=k == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("case", range(len(REASONING)))
def test_reasoning_whole_and_streamed_at_every_cut(think_tokenizer: Tokenizer, name: str,
                                                   case: int) -> None:
    text, reasoning, content = REASONING[case]
    parser = get_reasoning_parser(name)(think_tokenizer)
    assert stream_reasoning(ReasoningStreamer(parser), [text]) == (reasoning, content)
    for pieces in cuts(text):
        assert stream_reasoning(ReasoningStreamer(parser), pieces) == (reasoning, content), pieces


def test_reasoning_end_in_the_prompt_and_enable_thinking(think_tokenizer: Tokenizer) -> None:
    r1 = get_reasoning_parser("deepseek_r1")(think_tokenizer)
    qwen3 = get_reasoning_parser("qwen3")(think_tokenizer)
    ids = think_tokenizer.encode("user: hi <think> a </think> assistant:", add_special_tokens=False)
    assert r1.is_reasoning_end(ids)
    assert not r1.is_reasoning_end(ids + [r1.start_token_id])
    assert not r1.is_reasoning_end(think_tokenizer.encode("plain prompt", add_special_tokens=False))
    assert qwen3.thinks(None) and qwen3.thinks({"enable_thinking": True})
    assert not qwen3.thinks({"enable_thinking": False}) and r1.thinks({"enable_thinking": False})


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_reasoning_parser_needs_the_think_tokens(demo_tokenizer_dir: str, name: str) -> None:
    with pytest.raises(ValueError, match=r"no <think> and no </think> token"):
        get_reasoning_parser(name)(Tokenizer.from_pretrained(demo_tokenizer_dir))


def test_reasoning_then_tool_calls(think_tokenizer: Tokenizer) -> None:
    """The chat handler's composition: the reasoning first, the calls in the content after it."""
    text = ('The user wants weather; call the tool.</think>\n\n<tool_call>\n{"name": '
            '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    r1 = get_reasoning_parser("deepseek_r1")(think_tokenizer)
    for pieces in [[text]] + cuts(text, seeds=2):
        hermes = get_tool_parser("hermes")(WEATHER_TOOLS)          # one per stream
        parser = ChoiceParser(ReasoningStreamer(r1), ToolCallStreamer(hermes.parse, hermes.make_id),
                              "auto")
        reasoning, content, deltas, finish = "", "", [], None
        for k, piece in enumerate(pieces):
            delta, finish = parser.feed(piece, "stop" if k == len(pieces) - 1 else None)
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            deltas += delta.tool_calls or []
        assert reasoning == "The user wants weather; call the tool."
        assert content == "" and finish == "tool_calls"
        check_stream_shape(deltas, [{"function": {"name": "get_weather",
                                                  "arguments": '{"city": "Paris"}'}}])
