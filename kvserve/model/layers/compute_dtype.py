"""16-bit weights with float32 math (dtype "auto" on a CPU without bf16 instructions).

The model is built and loaded in the checkpoint's 16-bit dtype (so no float32 copy of the
weights ever exists); then set_compute_dtype keeps the big matrices -- linear, embedding and LM
head weights, the bytes a decode step streams -- 16-bit, and casts everything else (norm
weights, biases: a few KB) to the compute dtype. Layers with a `compute_dtype` attribute
(LinearBase, VocabParallelEmbedding) are told the compute dtype: their outputs are in it.
Where memory allows (ops.linear.keep_float32_copies), the linear layers and the LM head also
keep a prepacked float32 copy for large batches: `float32_copy` set here, made in their
process_weights_after_loading.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from kvserve.ops.linear import FLOAT32_COPY_ENV, keep_float32_copies

logger = logging.getLogger(__name__)


def set_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Run `model` in `dtype` while its linear / embedding weights keep their stored dtype.
    Call after loading the weights and before process_weights_after_loading."""
    kept: set[int] = set()
    copyable = []   # layers whose matmuls can use a float32 copy (not embedding lookups)
    for module in model.modules():
        if hasattr(module, "compute_dtype"):
            module.compute_dtype = dtype
            kept.add(id(module.weight))
            if hasattr(module, "float32_copy"):
                copyable.append(module)
    for param in model.parameters():
        if id(param) not in kept and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    copy_bytes = sum(m.weight.numel() for m in copyable) * torch.finfo(dtype).bits // 8
    keep = dtype == torch.float32 and bool(copyable) and keep_float32_copies(copy_bytes)
    for module in copyable:
        module.float32_copy = keep
    logger.info("16-bit weights, %s math: batches above the small-batch kernel's rows use %s "
                "(%s=auto|1|0).", dtype,
                f"prepacked float32 copies ({copy_bytes / 2**20:.0f} MiB)" if keep else
                "a float32 copy made per call (no resident copy)", FLOAT32_COPY_ENV)
