"""Pipeline parallelism: which layers a stage holds, and what passes between stages."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve import envs

PP_LAYER_PARTITION_ENV = "KVSERVE_PP_LAYER_PARTITION"


def get_pp_partition(num_layers: int, pp_size: int) -> list[int]:
    """Layers per stage: `KVSERVE_PP_LAYER_PARTITION` ("a,b,...") when set, else an even split
    whose remainder goes to the stages before the last (vLLM's rule: the last stage also
    holds the norm and the LM head)."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}.")
    text = envs.get(PP_LAYER_PARTITION_ENV)
    if text:
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            raise ValueError(f"{PP_LAYER_PARTITION_ENV}={text!r} is not a comma-separated list "
                             f"of layer counts.") from None
        if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={text!r} must give {pp_size} positive layer counts "
                f"(one per pipeline stage) that sum to the model's {num_layers} layers.")
        return parts
    if num_layers < pp_size:
        raise ValueError(f"The model has {num_layers} layers, which cannot be split over "
                         f"pipeline_parallel_size={pp_size} stages (each needs at least one).")
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` holds."""
    parts = get_pp_partition(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


@dataclass
class IntermediateTensors:
    """What a stage hands to the next: the residual stream after its last layer."""
    hidden_states: torch.Tensor   # [T, hidden]
    residual: torch.Tensor        # [T, hidden]

    def pack(self) -> torch.Tensor:
        """One [2, T, hidden] tensor: one send per step instead of two."""
        return torch.stack((self.hidden_states, self.residual))

    @staticmethod
    def unpack(x: torch.Tensor) -> "IntermediateTensors":
        return IntermediateTensors(x[0], x[1])


class PPMissingLayer(nn.Module):
    """Stands in for a module another stage holds, so parameter names keep their indices."""

    def forward(self, *args, **kwargs):   # never called: a stage runs only its own layers
        raise RuntimeError("PPMissingLayer.forward: this module belongs to another stage.")


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes ("model.layers.3.") of the modules this stage does not hold."""
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))
