"""Partial JSON tool calls: the helper of every parser whose calls are JSON objects
(hermes, llama3_json, mistral, tool_choice="required").

`scan_call(text, start)` reads the object that starts at `text[start] == "{"` as far as the
text goes and returns the call it describes: its name once the "name" string is complete, and
its arguments as the raw text of the "arguments" (or "parameters") value so far. The raw
text of a value being written is a prefix of its final text, so arguments stream as the model
writes them, with no re-serialisation that could disagree with the final parse. An arguments
value that is a JSON string (some models quote the object) is sent whole, decoded, once
complete.

The scan works on JSON tokens (a regex: whole strings at once), not characters.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import CallState

# A string (group 1: its closing quote, absent while it is being written), a structural
# character, or a run of anything else (numbers, literals, whitespace).
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(")?|[{}\[\]:,]|[^"{}\[\]:,\s]+|\s+')
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ScannedCall:
    call: CallState
    end: Optional[int]             # index just past the closing brace; None: not closed yet
    has_arguments: bool            # the object has an arguments / parameters key


def scan_call(text: str, start: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> ScannedCall:
    assert text[start] == "{"
    spans: dict[str, tuple[int, Optional[int]]] = {}     # key -> (value start, value end)
    depth, state, key, end = 0, "open", "", None
    for m in _TOKEN.finditer(text, start):
        tok = m.group()
        if tok.isspace():
            continue
        if tok[0] == '"' and m.group(1) is None:
            if depth == 1 and state == "value":
                spans[key] = (m.start(), None)
            break                                       # a string still being written
        if depth > 1:
            if tok in ("{", "["):
                depth += 1
            elif tok in ("}", "]"):
                depth -= 1
                if depth == 1:
                    spans[key] = (spans[key][0], m.end())
                    state = "comma"
            continue
        if state == "open":
            depth, state = 1, "key"
        elif state == "key" and tok[0] == '"':
            key, state = json.loads(tok), "colon"
        elif state == "colon" and tok == ":":
            state = "value"
        elif state == "value":
            if tok in ("{", "["):
                depth = 2
                spans[key] = (m.start(), None)
            else:       # a string or a literal; a literal at the very end may still grow
                complete = tok[0] == '"' or m.end() < len(text)
                spans[key] = (m.start(), m.end() if complete else None)
                state = "comma"
        elif state in ("key", "comma") and tok == "}":
            end = m.end()
            break
        elif state == "comma" and tok == ",":
            state = "key"
        else:
            break                                       # not JSON: stop where it breaks
    return ScannedCall(_call(text, spans, end, argument_keys), end,
                       any(k in spans for k in argument_keys))


def _call(text: str, spans: dict[str, tuple[int, Optional[int]]], end: Optional[int],
          argument_keys: tuple[str, ...]) -> CallState:
    name = None
    if "name" in spans and spans["name"][1] is not None:
        value = json.loads(text[spans["name"][0]:spans["name"][1]])
        name = value if isinstance(value, str) else None
    arguments = ""
    span = next((spans[k] for k in argument_keys if k in spans), None)
    if span is None:
        arguments = "{}" if end is not None else ""
    elif text[span[0]] in "{[":
        arguments = text[span[0]:span[1] if span[1] is not None else len(text)]
    elif span[1] is not None:
        value = json.loads(text[span[0]:span[1]])
        arguments = value if isinstance(value, str) else json.dumps(value)
    return CallState(name, arguments)


def value_end(text: str, pos: int) -> Optional[int]:
    """Index past the JSON object or array that starts at `text[pos]` (None: still open)."""
    depth = 0
    for m in _TOKEN.finditer(text, pos):
        tok = m.group()
        if tok[0] == '"' and m.group(1) is None:
            return None
        if tok in ("{", "["):
            depth += 1
        elif tok in ("}", "]"):
            depth -= 1
            if depth == 0:
                return m.end()
    return None


def skip_space(text: str, pos: int, extra: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in extra):
        pos += 1
    return pos


def scan_call_array(text: str, pos: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS
                    ) -> tuple[list[CallState], Optional[int]]:
    """The calls of a JSON array `[{...}, {...}]` starting at `text[pos] == "["`, and the
    index past its closing bracket (None while open)."""
    calls: list[CallState] = []
    pos = skip_space(text, pos + 1)
    while pos < len(text):
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != "{":
            break
        scanned = scan_call(text, pos, argument_keys)
        calls.append(scanned.call)
        if scanned.end is None:
            break
        pos = skip_space(text, scanned.end, ",")
    return calls, None
