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
from dataclasses import dataclass, field
from typing import Any, Optional

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


@dataclass
class _Scan:
    """Where the scan of one object stands: a stream resumes it on the longer text (the
    text only grows), so each token is read once however the text arrives."""
    pos: int
    depth: int = 0
    state: str = "open"
    key: str = ""
    end: Optional[int] = None
    spans: dict[str, tuple[int, Optional[int]]] = field(default_factory=dict)


def scan_call(text: str, start: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS,
              limit: Optional[int] = None, cache: Optional[dict[int, Any]] = None) -> ScannedCall:
    """The call in the object at `text[start]` ("{"), reading no further than `limit`.
    `cache` (one per stream) keeps the scan between calls."""
    assert text[start] == "{"
    limit = len(text) if limit is None else limit
    scan = cache.get(start) if cache is not None else None
    if scan is None:
        scan = _Scan(pos=start)
        if cache is not None:
            cache[start] = scan
    if scan.end is None and scan.state != "bad":
        _advance(text, scan, limit)
    return ScannedCall(_call(text, scan.spans, scan.end, argument_keys, limit), scan.end,
                       any(k in scan.spans for k in argument_keys))


def _advance(text: str, scan: _Scan, limit: int) -> None:
    for m in _TOKEN.finditer(text, scan.pos, limit):
        tok = m.group()
        if tok.isspace():
            scan.pos = m.end()
            continue
        if tok[0] == '"' and m.group(1) is None:
            if scan.depth == 1 and scan.state == "value":
                scan.spans[scan.key] = (m.start(), None)
            return                                      # a string still being written
        if scan.depth > 1:
            if tok in ("{", "["):
                scan.depth += 1
            elif tok in ("}", "]"):
                scan.depth -= 1
                if scan.depth == 1:
                    scan.spans[scan.key] = (scan.spans[scan.key][0], m.end())
                    scan.state = "comma"
        elif scan.state == "open":
            scan.depth, scan.state = 1, "key"
        elif scan.state == "key" and tok[0] == '"':
            scan.key, scan.state = json.loads(tok), "colon"
        elif scan.state == "colon" and tok == ":":
            scan.state = "value"
        elif scan.state == "value":
            if tok in ("{", "["):
                scan.depth = 2
                scan.spans[scan.key] = (m.start(), None)
            elif tok[0] == '"' or m.end() < limit:      # a literal at the end may still grow
                scan.spans[scan.key] = (m.start(), m.end())
                scan.state = "comma"
            else:
                return
        elif scan.state in ("key", "comma") and tok == "}":
            scan.end = scan.pos = m.end()
            return
        elif scan.state == "comma" and tok == ",":
            scan.state = "key"
        else:
            scan.state = "bad"                          # not JSON: stop where it breaks
            return
        scan.pos = m.end()


def _call(text: str, spans: dict[str, tuple[int, Optional[int]]], end: Optional[int],
          argument_keys: tuple[str, ...], limit: int) -> CallState:
    name = None
    if "name" in spans and spans["name"][1] is not None:
        value = json.loads(text[spans["name"][0]:spans["name"][1]])
        name = value if isinstance(value, str) else None
    arguments = ""
    span = next((spans[k] for k in argument_keys if k in spans), None)
    if span is None:
        arguments = "{}" if end is not None else ""
    elif text[span[0]] in "{[":
        arguments = text[span[0]:span[1] if span[1] is not None else limit]
    elif span[1] is not None:
        value = json.loads(text[span[0]:span[1]])
        arguments = value if isinstance(value, str) else json.dumps(value)
    return CallState(name, arguments)


def value_end(text: str, start: int, cache: Optional[dict[int, Any]] = None) -> Optional[int]:
    """Index past the JSON object or array that starts at `text[start]` (None: still open);
    `cache` keeps the scan between calls, as scan_call's."""
    scan = cache.get(start) if cache is not None else None
    if scan is None:
        scan = _Scan(pos=start)
        if cache is not None:
            cache[start] = scan
    for m in _TOKEN.finditer(text, scan.pos):
        if scan.end is not None:
            break
        tok = m.group()
        if tok[0] == '"' and m.group(1) is None:
            break
        if tok in ("{", "["):
            scan.depth += 1
        elif tok in ("}", "]"):
            scan.depth -= 1
            if scan.depth == 0:
                scan.end = m.end()
        scan.pos = m.end()
    return scan.end


def skip_space(text: str, pos: int, extra: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in extra):
        pos += 1
    return pos


def scan_call_array(text: str, pos: int, argument_keys: tuple[str, ...] = ARGUMENT_KEYS,
                    cache: Optional[dict[int, Any]] = None) -> tuple[list[CallState], Optional[int]]:
    """The calls of a JSON array `[{...}, {...}]` starting at `text[pos] == "["`, and the
    index past its closing bracket (None while open)."""
    calls: list[CallState] = []
    pos = skip_space(text, pos + 1)
    while pos < len(text):
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != "{":
            break
        scanned = scan_call(text, pos, argument_keys, cache=cache)
        calls.append(scanned.call)
        if scanned.end is None:
            break
        pos = skip_space(text, scanned.end, ",")
    return calls, None
