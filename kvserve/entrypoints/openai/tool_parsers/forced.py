"""Calls a tool_choice forces with structured outputs (the grammar writes them):
named (`{"type": "function", "function": {"name": N}}`): the whole text is N's arguments;
"required": a JSON array of `{"name": ..., "parameters": {...}}` (vLLM's format)."""
from __future__ import annotations

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (CallState, ParseResult,
                                                                         ToolParser)
from kvserve.entrypoints.openai.tool_parsers.json_calls import scan_call_array, skip_space


class NamedToolParser(ToolParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.function_name = name

    def parse(self, text: str, final: bool) -> ParseResult:
        return ParseResult(calls=[CallState(self.function_name, text)])


class RequiredToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParseResult:
        pos = skip_space(text, 0)
        if pos == len(text):
            return ParseResult()
        if text[pos] != "[":
            return ParseResult(content=text)
        calls, _ = scan_call_array(text, pos, ("parameters",), self.scans)
        return ParseResult(calls=calls)
