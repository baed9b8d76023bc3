"""mistral: content, then `[TOOL_CALLS]` and the calls, either a JSON array
`[{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) or, from v11 on,
`[TOOL_CALLS]name[ARGS]{...}` once per call. `[TOOL_CALLS]` is a special token: the request
is detokenized with special tokens kept. Call ids are 9 alphanumerics (Mistral's rule)."""
from __future__ import annotations

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (CallState, ParseResult,
                                                                         ToolParser,
                                                                         mistral_tool_id,
                                                                         partial_marker)
from kvserve.entrypoints.openai.tool_parsers.json_calls import (scan_call_array, skip_space,
                                                                value_end)
from kvserve.entrypoints.openai.tool_parsers.registry import register_tool_parser

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    needs_special_tokens = True

    def make_id(self) -> str:
        return mistral_tool_id()

    def parse(self, text: str, final: bool) -> ParseResult:
        i = text.find(BOT)
        if i < 0:
            keep = 0 if final else partial_marker(text, BOT)
            return ParseResult(content=text[:len(text) - keep])
        result = ParseResult(content=text[:i])
        pos = skip_space(text, i + len(BOT))
        if pos < len(text) and text[pos] == "[":
            result.calls, end = scan_call_array(text, pos, cache=self.scans)
            if end is not None:
                result.content += text[end:]
            return result
        while pos < len(text):                          # v11: name[ARGS]{...}, repeated
            a = text.find(ARGS, pos)
            if a < 0:
                return result
            result.calls.append(CallState(text[pos:a].strip()))
            args_at = skip_space(text, a + len(ARGS))
            if args_at == len(text) or text[args_at] != "{":
                return result
            end = value_end(text, args_at, self.scans)
            result.calls[-1].arguments = text[args_at:end or len(text)]
            if end is None:
                return result
            pos = skip_space(text, end)
            if text.startswith(BOT, pos):
                pos = skip_space(text, pos + len(BOT))
        return result
