"""Shared pieces of the structured output tests: schemas, validity checks, the engine args."""
from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

# Small and bounded, so that a random model finishes most outputs within max_tokens.
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,4}-\d{1,3}"
CHOICES = ["red", "green", "blue", "dark violet"]
# Balanced parentheses around digits: "(" then digits or a nested group, then ")".
EBNF = 'root ::= "(" inner ")"\ninner ::= [0-9] | [0-9] [0-9] | root'
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory=32 << 20, seed=0)


def load_json(text: str) -> Any:
    # Strict (no raw control characters in strings): what a client's parser accepts.
    return json.loads(text)


def is_valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(load_json(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def is_json_object(text: str) -> bool:
    try:
        return isinstance(load_json(text), dict)
    except json.JSONDecodeError:
        return False


def matches_ebnf(text: str) -> bool:
    """A recogniser for EBNF above: root := "(" (d | dd | root) ")"."""
    def parse(i: int) -> int:   # returns the index after a root at i, or -1
        if i >= len(text) or text[i] != "(":
            return -1
        j = i + 1
        m = re.match(r"[0-9]{1,2}\)", text[j:])
        if m:
            return j + m.end()
        k = parse(j)
        return k + 1 if k != -1 and k < len(text) and text[k] == ")" else -1
    return parse(0) == len(text)


def json_skeleton(text: str) -> str:
    """The JSON text with every string replaced by "s0", "s1", ...: what whitespace is left
    is the grammar's."""
    counter = iter(range(1 << 30))
    return re.sub(r'"(?:\\.|[^"\\])*"', lambda m: f'"s{next(counter)}"', text, flags=re.DOTALL)


def check_output(kind: str, spec: Any, text: str) -> bool:
    if kind == "json":
        return is_valid_json(text, spec)
    if kind == "json_object":
        return is_json_object(text)
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    if kind == "choice":
        return text in spec
    if kind == "grammar":
        return matches_ebnf(text)
    raise AssertionError(kind)
