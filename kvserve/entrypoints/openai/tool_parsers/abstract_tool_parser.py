"""The tool-call parser interface and the one streaming helper every parser shares.

A parser reads the text generated so far and says what it is: content, and tool calls each
with a name (once the text names it) and its arguments so far. `parse(text, final)` must be
*monotone*: for a longer text, the content and every call's arguments only grow at the end
(the earlier results are prefixes of the later ones), a call's name never changes once given,
and calls are never removed. Text that may still turn into a call (a tail like "<tool_c") is
held back until `final` says no more text comes.

With that rule one diff turns parses into stream deltas (`ToolCallStreamer`), and the
non-streamed answer is the same streamer fed the whole text once: a stream's concatenated
content and arguments equal the non-streamed ones for every way the text is cut into deltas.
vLLM's delta shape: a call's first delta carries index, id, type and function.name (with the
arguments known so far), the next ones function.arguments pieces only.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class CallState:
    """One tool call as far as the text shows it."""
    name: Optional[str]            # None until the text names the function
    arguments: str = ""            # JSON text of the arguments so far (a prefix of the final)


@dataclass
class ParseResult:
    content: str = ""
    calls: list[CallState] = field(default_factory=list)


class ToolParser:
    """Base of the `--tool-call-parser` parsers: one instance per generated choice (it keeps
    the state of its scans between the parses of one stream)."""

    name = ""
    # The parser's markers are special tokens the detokenizer would otherwise drop.
    needs_special_tokens = False

    def __init__(self, tools: Optional[list[dict[str, Any]]] = None) -> None:
        self.tools = tools or []
        # Scans of partial JSON kept between the parses of one stream (json_calls.py).
        self.scans: dict[int, Any] = {}

    def parse(self, text: str, final: bool) -> ParseResult:
        """The monotone parse of the text so far (module docstring)."""
        raise NotImplementedError

    def make_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def tool_parameters(self, name: str) -> dict[str, Any]:
        """The `properties` of function `name`'s JSON schema ({} if unknown)."""
        for tool in self.tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(fn, dict) and fn.get("name") == name:
                return (fn.get("parameters") or {}).get("properties") or {}
        return {}


def mistral_tool_id() -> str:
    """Mistral's templates accept only 9 alphanumeric characters as a call id."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


def partial_marker(text: str, *markers: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`
    (text to hold back: it may become the marker)."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


class JsonArguments:
    """`json.dumps(dict(pairs))` written pair by pair: the text for the first k pairs is a
    prefix of the text for all of them, so arguments whose values come one at a time
    (pythonic, qwen3_coder) stream as they complete. It also keeps where in the model's text
    the next pair starts (`pos`) and where the call ended (`end`), so that a stream reads each
    pair once."""

    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.end: Optional[int] = None
        self._body = ""

    def add(self, key: str, value: Any) -> None:
        pair = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._body += f", {pair}" if self._body else pair

    def text(self) -> str:
        return "{" + self._body + ("}" if self.end is not None else "")


class ToolCallStreamer:
    """Diffs successive parses into (content delta, tool-call deltas).

    Content: trailing whitespace is held until more content follows, and dropped at the end
    (the blank lines between and after calls are not content). `max_calls`: calls past it
    are dropped (`parallel_tool_calls=false` keeps the first)."""

    def __init__(self, parse: Callable[[str, bool], ParseResult],
                 make_id: Callable[[], str], max_calls: Optional[int] = None) -> None:
        self._parse = parse
        self._make_id = make_id
        self.max_calls = max_calls
        self.text = ""
        self._sent_content = 0
        self._sent: list[tuple[str, str, int]] = []     # per call sent: (id, name, args sent)

    @property
    def num_calls(self) -> int:
        return len(self._sent)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        result = self._parse(self.text, final)
        visible = result.content.rstrip()
        content = visible[self._sent_content:]
        self._sent_content = max(self._sent_content, len(visible))
        calls = result.calls if self.max_calls is None else result.calls[:self.max_calls]
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break                      # calls are named in order
            if index == len(self._sent):
                call_id = self._make_id()
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self._sent.append((call_id, call.name, len(call.arguments)))
                continue
            call_id, name, sent = self._sent[index]
            if len(call.arguments) > sent:
                deltas.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
                self._sent[index] = (call_id, name, len(call.arguments))
        return content, deltas


def collect_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole tool calls (the non-streamed message's) from the deltas of one final feed."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": dict(d["function"])}
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]
