"""Chat tool calls forced with structured outputs: the schema a tool_choice imposes.

- `tool_choice={"type": "function", "function": {"name": N}}` (named): the output is
  constrained to N's `parameters` schema; the whole text is N's arguments.
- `tool_choice="required"`: the output is constrained to a JSON array of
  `{"name": ..., "parameters": {...}}` objects, one of the tools each (vLLM's format).

`tool_choice="auto"` leaves the model free; a `--tool-call-parser` finds the calls in its
text. Parsing, forced or not, is in tool_parsers/.
"""
from __future__ import annotations

from typing import Any, Optional


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': "
                             f"{{'name': ..., 'parameters': {{...}}}}}}.")
        out[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    return out


def named_tool(tool_choice: Any) -> Optional[str]:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise ValueError("A named tool_choice must be {'type': 'function', 'function': "
                             "{'name': ...}}.")
        return str(fn["name"])
    return None


def tool_choice_schema(tools: Optional[list[dict[str, Any]]], tool_choice: Any) -> Optional[dict]:
    """The JSON schema the output must follow for a forced tool choice (None: not forced)."""
    name = named_tool(tool_choice)
    if name is None and tool_choice != "required":
        return None
    if not tools:
        raise ValueError(f"tool_choice={tool_choice!r} needs a non-empty `tools` list.")
    functions = _functions(tools)
    if name is not None:
        if name not in functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                             f"({sorted(functions)}).")
        return functions[name]
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [n]}, "parameters": schema},
              "required": ["name", "parameters"]} for n, schema in functions.items()]
    return {"type": "array", "minItems": 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
