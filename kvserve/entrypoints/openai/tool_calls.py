"""Chat tool calls: forcing them with structured outputs, and parsing them out of the text.

- `tool_choice={"type": "function", "function": {"name": N}}` (named): the output is
  constrained to N's `parameters` schema; the whole text is N's arguments.
- `tool_choice="required"`: the output is constrained to a JSON array of
  `{"name": ..., "parameters": {...}}` objects, one of the tools each (vLLM's format).
- `tool_choice="auto"` with `--enable-auto-tool-choice --tool-call-parser hermes`: the model
  is free; `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in its text become
  tool calls and the rest stays content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

TOOL_CALL_PARSERS = ("hermes",)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_START = "<tool_call>"


def _tool_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_tool_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": _tool_id(), "type": "function", "function": {"name": name, "arguments": args}}


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             f"{{'name': ..., 'parameters': {{...}}}}}}.")
        out[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


def named_tool(tool_choice: Any) -> Optional[str]:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError("A named tool_choice must be {'type': 'function', 'function': "
                             "{'name': ...}}.")
        return str(fn["name"])
    return None


def tool_choice_schema(tools: Optional[list[dict[str, Any]]], tool_choice: Any) -> Optional[dict]:
    """The JSON schema the output must follow for a forced tool choice (None: not forced)."""
    name = named_tool(tool_choice)
    if name is None and tool_choice != "required":
        return None
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs a non-empty `tools` list.")
    functions = _functions(tools)
    if name is not None:
        if name not in functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({sorted(functions)}).")
        return functions[name]
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [n]}, "parameters": schema},
              "required": ["name", "parameters"]} for n, schema in functions.items()]
    return {"type": "array", "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}


@dataclass
class ParsedToolCalls:
    content: Optional[str]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse_forced(text: str, tool_choice: Any) -> ParsedToolCalls:
    """The text of a named / required tool call (constrained, so it parses when finished)."""
    name = named_tool(tool_choice)
    if name is not None:
        return ParsedToolCalls(content=None, tool_calls=[make_tool_call(name, text)])
    try:
        calls = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return ParsedToolCalls(content=text)   # cut off by max_tokens: give back the text
    return ParsedToolCalls(content=None, tool_calls=[
        make_tool_call(c["name"], c.get("parameters", {})) for c in calls])


def parse_hermes(text: str) -> ParsedToolCalls:
    calls = []
    for block in _HERMES.findall(text):
        try:
            obj = json.loads(block, strict=False)
            calls.append(make_tool_call(obj["name"], obj.get("arguments", {})))
        except (json.JSONDecodeError, KeyError, TypeError):
            return ParsedToolCalls(content=text)   # not a valid call: the text is content
    if not calls:
        return ParsedToolCalls(content=text)
    content = _HERMES.sub("", text).strip()
    return ParsedToolCalls(content=content or None, tool_calls=calls)


class ToolCallStreamer:
    """Turns a choice's text deltas into (content delta, tool-call deltas) the way vLLM
    streams them: the first delta of a call carries index, id, type and name, later ones only
    argument text. Named calls stream their arguments as they come; required and hermes calls
    are sent whole when each completes."""

    def __init__(self, tool_choice: Any, mode: str) -> None:
        self.mode = mode                  # "named" | "required" | "hermes"
        self.name = named_tool(tool_choice)
        self.text = ""
        self.sent_content = 0             # chars of `text` already sent as content
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self.mode == "named":
            calls = []
            if self.num_calls == 0:
                self.num_calls = 1
                calls.append({"index": 0, "id": _tool_id(), "type": "function",
                              "function": {"name": self.name, "arguments": delta}})
            elif delta:
                calls.append({"index": 0, "function": {"arguments": delta}})
            return "", calls
        if self.mode == "required":
            if not finished:
                return "", []
            parsed = parse_forced(self.text, "required")
            return parsed.content or "", self._number(parsed.tool_calls)
        return self._feed_hermes(finished)

    def _feed_hermes(self, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", []
        while True:
            rest = self.text[self.sent_content:]
            start = rest.find(_HERMES_START)
            if start < 0:
                # Hold back a tail that could be the start of "<tool_call>".
                keep = 0 if finished else _partial_prefix(rest, _HERMES_START)
                content += rest[:len(rest) - keep]
                self.sent_content += len(rest) - keep
                return content, calls
            content += rest[:start]
            match = _HERMES.match(rest, start)
            if match is None:                       # the call is not closed yet
                self.sent_content += start
                if finished:
                    content += rest[start:]
                    self.sent_content = len(self.text)
                return content, calls
            parsed = parse_hermes(match.group(0))
            if parsed.tool_calls:
                calls += self._number(parsed.tool_calls)
            else:
                content += match.group(0)
            self.sent_content += match.end()

    def _number(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"index": self.num_calls, **call})
            self.num_calls += 1
        return out


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
