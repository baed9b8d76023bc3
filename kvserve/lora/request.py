"""LoRARequest: which adapter a request runs with (vLLM's class, same fields)."""
from __future__ import annotations

from typing import Any, Optional

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):  # type: ignore[call-arg]
    """`lora_int_id` (>= 1) identifies the adapter inside the engine; `lora_name` is what the
    API's `model` field selects; `lora_path` is a PEFT adapter directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}.")
        if not self.lora_name:
            raise ValueError("lora_name cannot be empty.")


def as_lora_request(value: Any) -> Optional[LoRARequest]:
    """A LoRARequest from what crossed a process boundary: core/ carries it untyped (core sits
    below lora/ in the import layers), so msgpack hands a dict to the engine core."""
    if value is None or isinstance(value, LoRARequest):
        return value
    if isinstance(value, dict):
        return LoRARequest(**value)
    if isinstance(value, (list, tuple)):
        return LoRARequest(*value)
    raise ValueError(f"lora_request must be a LoRARequest, got {type(value).__name__}.")


class LoRAModulePath(msgspec.Struct, frozen=True):
    """One `--lora-modules` entry: `name=path` or JSON {"name", "path", "base_model_name"}."""
    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_lora_modules(items: Optional[list[str]]) -> list[LoRAModulePath]:
    """vLLM's --lora-modules forms; a malformed entry is a ValueError naming it."""
    out: list[LoRAModulePath] = []
    for item in items or []:
        item = item.strip()
        if item.startswith("{"):
            try:
                out.append(msgspec.json.decode(item.encode(), type=LoRAModulePath))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise ValueError(f"--lora-modules {item!r}: {e} (JSON form: "
                                 f"'{{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}').") from None
            continue
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected name=path or JSON "
                             f"{{\"name\": ..., \"path\": ...}}.")
        out.append(LoRAModulePath(name, path))
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must be unique, got {names}.")
    return out
