"""16-bit weights with float32 math (dtype "auto" on a CPU without bf16 instructions).

The model is built and loaded in the checkpoint's 16-bit dtype (so no float32 copy of the
weights ever exists); then set_compute_dtype keeps the big matrices -- linear, embedding and LM
head weights, the bytes a decode step streams -- 16-bit, and casts everything else (norm
weights, biases: a few KB) to the compute dtype. Layers with a `compute_dtype` attribute
(LinearBase, VocabParallelEmbedding) are told the compute dtype: their outputs are in it.
"""
from __future__ import annotations

import torch
from torch import nn


def set_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Run `model` in `dtype` while its linear / embedding weights keep their stored dtype.
    Call after loading the weights and before process_weights_after_loading."""
    kept: set[int] = set()
    for module in model.modules():
        if hasattr(module, "compute_dtype"):
            module.compute_dtype = dtype
            kept.add(id(module.weight))
    for param in model.parameters():
        if id(param) not in kept and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
