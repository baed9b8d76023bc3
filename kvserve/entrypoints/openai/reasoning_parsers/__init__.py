"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names); see abstract_reasoning_parser.py."""
from kvserve.entrypoints.openai.reasoning_parsers import deepseek_r1, qwen3  # noqa: F401
from kvserve.entrypoints.openai.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser, ReasoningStreamer)
from kvserve.entrypoints.openai.reasoning_parsers.registry import (get_reasoning_parser,
                                                                   reasoning_parser_names)

__all__ = ["ReasoningParser", "ReasoningStreamer", "get_reasoning_parser",
           "reasoning_parser_names"]
