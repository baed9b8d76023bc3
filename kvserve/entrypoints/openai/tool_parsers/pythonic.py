"""pythonic (Llama 3.2 / 4 and others): the whole output is a Python list of calls with
keyword arguments, `[get_weather(city='Paris', days=3), get_time()]`. Each argument value is
a Python literal; the arguments are sent as JSON, one argument at a time as each value
completes. An output that does not start like such a list is content (vLLM's rule)."""
from __future__ import annotations

import ast
import re
from typing import Any, Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (CallState, ParseResult,
                                                                         ToolParser,
                                                                         JsonArguments)
from kvserve.entrypoints.openai.tool_parsers.registry import register_tool_parser

_START = re.compile(r"\s*\[\s*(?=[A-Za-z_][\w.]*\s*\()")
_MAYBE_START = re.compile(r"\s*(\[\s*([A-Za-z_][\w.]*\s*)?)?")
_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
_CLOSE = re.compile(r"\s*\)")
# A string (q1 / q2: its closing quote, absent while open), a bracket or comma, anything else.
_TOKEN = re.compile(r"""(?P<str>[rRbBuU]{0,2}(?:'(?:[^'\\\n]|\\.)*(?P<q1>')?"""
                    r"""|"(?:[^"\\\n]|\\.)*(?P<q2>")?))|[()\[\]{},]|[^'"()\[\]{},]+""")


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    def __init__(self, tools: Optional[list[dict[str, Any]]] = None) -> None:
        super().__init__(tools)
        self.values: dict[int, tuple[int, int]] = {}   # value start -> (scanned to, depth)

    def parse(self, text: str, final: bool) -> ParseResult:
        start = _START.match(text)
        if start is None:
            if not final and _MAYBE_START.fullmatch(text):
                return ParseResult()                     # may still become a call list
            return ParseResult(content=text)
        result = ParseResult()
        pos = start.end()
        while True:
            call_match = _CALL.match(text, pos)
            if call_match is None:
                return result
            call = CallState(call_match.group(1))
            result.calls.append(call)
            pos = self._arguments(text, call_match.end(), call)
            if pos is None:
                return result
            rest = re.compile(r"\s*([,\]])").match(text, pos)
            if rest is None:
                return result
            pos = rest.end()
            if rest.group(1) == "]":
                result.content = text[pos:]
                return result

    def _arguments(self, text: str, start: int, call: CallState) -> Optional[int]:
        """Fill `call.arguments` with the keyword arguments complete so far; the index past
        the call's ")" once it is closed (None before)."""
        args = self.scans.setdefault(start, JsonArguments(start))
        while args.end is None:
            close = _CLOSE.match(text, args.pos)
            if close is not None:
                args.end = close.end()
                break
            keyword = _KEYWORD.match(text, args.pos)
            end = self._value_end(text, keyword.end()) if keyword is not None else None
            if keyword is None or end is None:
                break
            try:
                value = ast.literal_eval(text[keyword.end():end].strip())
            except (ValueError, SyntaxError):
                break                                    # not a literal: the call stops here
            args.add(keyword.group(1), value)
            args.pos = end + 1 if text[end] == "," else end
        call.arguments = args.text()
        return args.end

    def _value_end(self, text: str, start: int) -> Optional[int]:
        """Where the argument value starting at `start` ends: the top-level "," or ")" after
        it (None: not written yet). The scan resumes where the last parse left it."""
        pos, depth = self.values.get(start, (start, 0))
        end = None
        for m in _TOKEN.finditer(text, pos):
            tok = m.group()
            if m.group("str") is not None and m.group("q1") is None and m.group("q2") is None:
                break                                    # a string still being written
            if tok in ("(", "[", "{"):
                depth += 1
            elif tok in (",", ")", "]", "}"):
                if depth == 0:
                    end = m.start()
                    break
                depth -= tok != ","
            pos = m.end()
        self.values[start] = (pos, depth)
        return end
