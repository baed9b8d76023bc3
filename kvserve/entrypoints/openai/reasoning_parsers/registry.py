"""Reasoning parsers by their `--reasoning-parser` name (vLLM's names)."""
from kvserve.entrypoints.openai.tool_parsers.registry import Registry

REASONING_PARSERS = Registry("--reasoning-parser")
register_reasoning_parser = REASONING_PARSERS.register
get_reasoning_parser = REASONING_PARSERS.get
reasoning_parser_names = REASONING_PARSERS.names
