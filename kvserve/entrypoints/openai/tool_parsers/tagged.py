"""Calls written between a start and an end tag (hermes' and qwen3_coder's `<tool_call>`
blocks), the text around them content. The body parser says which call a block is; a block
it cannot name is content once the block is closed (or the text is final), and held back
until then."""
from __future__ import annotations

from typing import Callable, Optional

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (CallState, ParseResult,
                                                                         partial_marker)

# (text, body start, body end, whether the block is closed) -> the call (None: not nameable
# (yet)). Positions are the whole text's, so that a parser may keep state per block.
BodyParser = Callable[[str, int, int, bool], Optional[CallState]]


def parse_tagged(text: str, final: bool, start_tag: str, end_tag: str,
                 parse_body: BodyParser) -> ParseResult:
    result = ParseResult()
    pos = 0
    while True:
        i = text.find(start_tag, pos)
        if i < 0:
            tail = text[pos:]
            result.content += tail if final else tail[:len(tail) - partial_marker(tail, start_tag)]
            return result
        result.content += text[pos:i]
        body_start = i + len(start_tag)
        j = text.find(end_tag, body_start)
        closed = j >= 0
        body_end = j if closed else len(text)
        if not closed and not final:
            # "</tool_c" at the end belongs to the end tag, not to the call's body.
            body_end -= partial_marker(text[body_start:], end_tag)
        call = parse_body(text, body_start, body_end, closed or final)
        if call is None:
            if not (closed or final):
                return result                  # undecided: hold the block back
            block_end = j + len(end_tag) if closed else len(text)
            result.content += text[i:block_end]
        else:
            result.calls.append(call)
            if not closed:
                return result
        pos = j + len(end_tag) if closed else len(text)
