"""deepseek_r1 (DeepSeek-R1 and its distills, QwQ): the template opens `<think>` in the prompt,
so the output starts in the reasoning; `</think>` ends it. A `<think>` the model writes itself
(R1-0528) is dropped. No `</think>` at all (cut off by max_tokens): all reasoning."""
from __future__ import annotations

from kvserve.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import ReasoningParser
from kvserve.entrypoints.openai.reasoning_parsers.registry import register_reasoning_parser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    pass
