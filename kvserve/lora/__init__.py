"""Multi-LoRA serving: PEFT adapters on one base model, mixed in one batch.

    request.py     LoRARequest (vLLM's name and fields), carried by EngineCoreRequest
    config.py      LoRAConfig (--enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras)
    peft_loader.py adapter_config.json + adapter_model.safetensors -> LoRAModel (checked)
    layers.py      LoRALinear: the stacked per-slot A/B of one linear layer, batched delta
    punica.py      shrink / expand grouped by slot (torch), the per-step LoRAMapping
    manager.py     worker side: fixed slots, an LRU of loaded adapters, per-step mapping
    scheduling.py  scheduler hook: <= max_loras adapters running, adapters loaded at add time
"""
from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
