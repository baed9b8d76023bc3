"""LoRAConfig: the engine's LoRA settings (vLLM's flags)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# The ranks vLLM accepts for --max-lora-rank.
SUPPORTED_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    max_loras: int = 1                   # adapters in one batch (GPU/CPU slots)
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # loaded adapters kept (LRU); default max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if self.max_lora_rank not in SUPPORTED_MAX_RANKS:
            raise ValueError(f"max_lora_rank must be one of {SUPPORTED_MAX_RANKS}, got "
                             f"{self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}).")
