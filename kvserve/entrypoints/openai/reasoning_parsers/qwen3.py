"""qwen3 (Qwen3, QwQ-style Qwen3 thinking models, Qwen3.5): the reasoning ends at `</think>`;
`<think>` is written by the model (Qwen3 up to 2507) or by the template (later ones), both
handled as in vLLM's current parser. `chat_template_kwargs={"enable_thinking": false}` turns
reasoning off: the whole output is content (the template then closes the reasoning in the
prompt, which the server also sees)."""
from __future__ import annotations

from typing import Any, Optional

from kvserve.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import ReasoningParser
from kvserve.entrypoints.openai.reasoning_parsers.registry import register_reasoning_parser


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    def thinks(self, chat_template_kwargs: Optional[dict[str, Any]]) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False
