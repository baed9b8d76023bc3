"""The engine's JSON-valued settings (`--structured-outputs-config`, `--speculative-config`,
`--kv-transfer-config`): one parser, so they fail the same way."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, TypeVar, Union

T = TypeVar("T")


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


def parse_setting(cls: type[T], value: Any, name: str) -> T:
    """A JSON-valued setting as its dataclass: None gives the defaults, an instance stays as
    it is, anything else goes through parse_json_config."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    return cls(**parse_json_config(value, name, cls))
