"""The engine's JSON-valued settings (`--structured-outputs-config`, `--speculative-config`,
`--kv-transfer-config`): one parser, so they fail the same way."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Union


def parse_json_config(value: Union[str, dict], name: str, cls: type) -> dict:
    """A `--name` JSON string or a dict, checked against the dataclass `cls`'s fields: bad
    JSON, a non-object or an unknown key is a ValueError naming the setting."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}.")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"Unknown {name} key(s) {unknown}; known: {sorted(known)}.")
    return value
