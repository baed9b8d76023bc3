"""qwen3_coder (Qwen3-Coder): XML-like calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text, converted by the type the tool's schema gives the parameter
(vLLM's rules: strings stay, integers and numbers are parsed, booleans are "true"/"false",
objects and arrays are JSON or Python literals, "null" is null; an unknown parameter stays a
string). The arguments are sent as JSON, one parameter at a time as each closes."""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (CallState, ParseResult,
                                                                         ToolParser,
                                                                         JsonArguments)
from kvserve.entrypoints.openai.tool_parsers.registry import register_tool_parser
from kvserve.entrypoints.openai.tool_parsers.tagged import parse_tagged

_FUNCTION = re.compile(r"<function=([^>\n]*)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def convert_value(value: str, schema: Optional[dict[str, Any]]) -> Any:
    if value.lower() == "null":
        return None
    if schema is None:
        return value
    kind = str(schema.get("type", "string")).strip().lower()
    try:
        if kind in _STRING_TYPES:
            return value
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
    except ValueError:
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    def __init__(self, tools: Optional[list[dict[str, Any]]] = None) -> None:
        super().__init__(tools)
        self.names: dict[int, str] = {}                 # block start -> function name

    def parse(self, text: str, final: bool) -> ParseResult:
        return parse_tagged(text, final, "<tool_call>", "</tool_call>", self._body)

    def _body(self, text: str, start: int, end: int, closed: bool) -> Optional[CallState]:
        args = self.scans.get(start)
        if args is None:
            function = _FUNCTION.search(text, start, end)
            if function is None:
                return None
            args = self.scans[start] = JsonArguments(function.end())
            self.names[start] = function.group(1).strip()
        name = self.names[start]
        properties = self.tool_parameters(name)
        for m in _PARAMETER.finditer(text, args.pos, end):
            value = m.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = m.group(1).strip()
            args.add(key, convert_value(value, properties.get(key)))
            args.pos = m.end()
        if args.end is None and (closed or text.find("</function>", args.pos, end) >= 0):
            args.end = end
        return CallState(name, args.text())
