"""Tool-call parsers (`--enable-auto-tool-choice --tool-call-parser NAME`, vLLM's names) and
the parsers of forced tool choices. See abstract_tool_parser.py for the interface."""
from kvserve.entrypoints.openai.tool_parsers import (hermes, llama3_json, mistral,  # noqa: F401
                                                    pythonic, qwen3_coder)
from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (CallState, ParseResult,
                                                                         ToolCallStreamer,
                                                                         ToolParser,
                                                                         collect_calls)
from kvserve.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from kvserve.entrypoints.openai.tool_parsers.registry import get_tool_parser, tool_parser_names

__all__ = ["CallState", "ParseResult", "ToolCallStreamer", "ToolParser", "collect_calls",
           "NamedToolParser", "RequiredToolParser", "get_tool_parser", "tool_parser_names"]
