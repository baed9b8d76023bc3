"""The engine core's per-request structured output state."""
from __future__ import annotations

import json
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.backend_types import StructuredOutputGrammar


def grammar_key(params: StructuredOutputsParams, default_disable_ws: bool) -> tuple[str, Any]:
    """(kind, spec): the cache key and the compiler's input. Equal constraints share one
    compiled grammar, whoever sent them."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        text = schema if isinstance(schema, str) else json.dumps(schema)
        any_ws = not (params.disable_any_whitespace or default_disable_ws)
        return kind, (text, any_ws)
    if kind == "json_object":
        return kind, not (params.disable_any_whitespace or default_disable_ws)
    if kind == "choice":
        # A choice is a one-rule EBNF grammar; JSON string escapes are EBNF's escapes.
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice or [])
        return "grammar", f"root ::= {alts}"
    return kind, getattr(params, kind)


@dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    key: tuple[str, Any]
    future: Optional["Future[Any]"] = None
    grammar: Optional[StructuredOutputGrammar] = None
    error: Optional[str] = None
    # The matcher while the request still reasons (`params.reasoning_end_token_id` not yet
    # generated): `grammar` stays None until then, so nothing constrains the reasoning.
    waiting_grammar: Optional[StructuredOutputGrammar] = None

    def is_ready(self) -> bool:
        return (self.grammar is not None or self.waiting_grammar is not None
                or self.error is not None) or (
            self.future is not None and self.future.done())
