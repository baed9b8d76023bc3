"""config.json `architectures` name -> model class."""
from __future__ import annotations

from torch import nn

from kvserve.model.llama import (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                 Qwen3ForCausalLM)
from kvserve.model.phi3 import Phi3ForCausalLM
from kvserve.model.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        shown = repr(architecture) if architecture else "(none: config.json has no 'architectures')"
        raise ValueError(f"Model architecture {shown} is not supported. Supported architectures: "
                         f"{', '.join(supported_architectures())}.") from None
