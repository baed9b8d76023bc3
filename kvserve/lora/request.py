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
