"""hermes (Qwen2.5, Hermes, many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks; the text outside them is content."""
from __future__ import annotations

from typing import Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (CallState, ParseResult,
                                                                         ToolParser)
from kvserve.entrypoints.openai.tool_parsers.json_calls import scan_call, skip_space
from kvserve.entrypoints.openai.tool_parsers.registry import register_tool_parser
from kvserve.entrypoints.openai.tool_parsers.tagged import parse_tagged


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParseResult:
        return parse_tagged(text, final, "<tool_call>", "</tool_call>", self._body)

    def _body(self, text: str, start: int, end: int, closed: bool) -> Optional[CallState]:
        """One JSON call object (blank lines around it allowed); a call once it is named."""
        pos = skip_space(text, start)
        if pos >= end or text[pos] != "{":
            return None
        call = scan_call(text, pos, limit=end, cache=self.scans).call
        return call if call.name is not None else None
