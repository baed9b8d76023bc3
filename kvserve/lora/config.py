"""LoRAConfig: the engine's LoRA settings (vLLM's flags)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

# vLLM's --lora-dtype choices (float32 as well: a 16-bit base may keep float32 adapters).
LORA_DTYPES = ("auto", "bfloat16", "float16", "float32")
# The ranks vLLM accepts for --max-lora-rank.
SUPPORTED_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoRAConfig:
    max_loras: int = 1                   # adapters in one batch (GPU/CPU slots)
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # loaded adapters kept (LRU); default max_loras
    lora_dtype: str = "auto"             # the adapters' stacks: auto (the base's) | a dtype

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if self.max_lora_rank not in SUPPORTED_MAX_RANKS:
            raise ValueError(f"max_lora_rank must be one of {SUPPORTED_MAX_RANKS}, got "
                             f"{self.max_lora_rank}.")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got "
                             f"{self.lora_dtype!r}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}).")


def stack_dtype(lora_dtype: str, base_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of an adapter's A / B stacks: the base layer's (auto), else lora_dtype;
    float16 on CPU is bfloat16 (as --dtype float16 is there: no fast fp16 math). A 16-bit
    stack beside float32 activations is widened in the kernels' registers, so it streams half
    the bytes a step (--lora-dtype bfloat16 on a float32 model)."""
    if lora_dtype == "auto":
        return base_dtype
    dtype = getattr(torch, lora_dtype)
    return torch.bfloat16 if dtype == torch.float16 and device.type == "cpu" else dtype
