"""llama3_json (Llama 3.1 / 3.2 JSON tool calling): the output is one or more JSON objects
`{"name": ..., "parameters": {...}}` (or "arguments"), separated by ";", optionally after
`<|python_tag|>`. An output that does not start with an object is content (vLLM's rule); text
after the last call is content too."""
from __future__ import annotations

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ParseResult, ToolParser
from kvserve.entrypoints.openai.tool_parsers.json_calls import scan_call, skip_space
from kvserve.entrypoints.openai.tool_parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    needs_special_tokens = True        # <|python_tag|> is a special token

    def parse(self, text: str, final: bool) -> ParseResult:
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[pos:]):
            return ParseResult()                       # may still become the tag
        if pos == len(text):
            return ParseResult(content=text if final else "")
        if text[pos] != "{":
            return ParseResult(content=text)
        result = ParseResult()
        while True:
            scanned = scan_call(text, pos, cache=self.scans)
            if scanned.call.name is None or not scanned.has_arguments:
                if scanned.end is None and not final:
                    return result                      # undecided
                result.content = text[pos:]            # a JSON answer, not a call
                return result
            result.calls.append(scanned.call)
            if scanned.end is None:
                return result
            pos = skip_space(text, scanned.end, ";")
            if pos == len(text) or text[pos] != "{":
                rest = text[skip_space(text, scanned.end):]
                # ";" and spaces may still separate another call
                if final or rest.strip("; \t\r\n"):
                    result.content = rest.lstrip(";")
                return result
