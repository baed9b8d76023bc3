"""Choosing the attention backend: once, at start, from `attention_backend` (vLLM's name) and
the device; the choice is logged ("Using X attention backend")."""
from __future__ import annotations

import importlib
import logging
from typing import Optional

import torch

from kvserve.attention.backends.base import AttentionBackend

logger = logging.getLogger(__name__)

_BACKENDS = {
    "CPU_ATTN": ("kvserve.attention.backends.cpu", "CpuAttentionBackend"),
    "TORCH_SDPA": ("kvserve.attention.backends.torch_sdpa", "TorchSDPABackend"),
    "TRITON_ATTN": ("kvserve.attention.backends.triton", "TritonAttentionBackend"),
}
BACKEND_NAMES = tuple(_BACKENDS)
TRITON_BLOCK_SIZES = (16, 32, 64)    # tl.dot needs >= 16 keys per tile


def default_backend_name(device: str) -> str:
    return "TRITON_ATTN" if device.startswith("cuda") else "CPU_ATTN"


def _triton_problem(device: str, block_size: int, head_dim: int) -> Optional[str]:
    """Why TRITON_ATTN cannot run here (None if it can)."""
    from kvserve.attention.ops.common import interpreting
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton; CUDA builds of torch ship it)"
    if not device.startswith("cuda") and not interpreting():
        return ("on CPU Triton kernels run only under its interpreter (TRITON_INTERPRET=1, "
                "for tests)")
    if block_size not in TRITON_BLOCK_SIZES:
        return f"block_size must be one of {TRITON_BLOCK_SIZES}, got {block_size}"
    if head_dim > 256:
        return f"head_dim {head_dim} > 256"
    return None


def resolve_backend_name(name: Optional[str], device: str, block_size: int,
                         head_dim: int) -> str:
    """The backend to use: `name` checked (ValueError if it cannot run here), or the
    device's default (TRITON_ATTN on CUDA, falling back to TORCH_SDPA where it cannot run)."""
    if name is None:
        name = default_backend_name(device)
        if name == "TRITON_ATTN":
            why = _triton_problem(device, block_size, head_dim)
            if why is not None:
                logger.warning("TRITON_ATTN unavailable (%s): using TORCH_SDPA.", why)
                name = "TORCH_SDPA"
        return name
    name = name.upper()
    if name not in _BACKENDS:
        raise ValueError(f"Unknown attention_backend {name!r}; supported: "
                         f"{', '.join(BACKEND_NAMES)}.")
    if name == "CPU_ATTN" and not device.startswith("cpu"):
        raise ValueError(f"attention_backend CPU_ATTN runs on CPU only (device is {device}); "
                         f"use TRITON_ATTN or TORCH_SDPA.")
    if name == "TRITON_ATTN":
        why = _triton_problem(device, block_size, head_dim)
        if why is not None:
            raise ValueError(f"attention_backend TRITON_ATTN cannot run here: {why}.")
    return name


def get_attn_backend(name: str, device: torch.device) -> AttentionBackend:
    module, cls = _BACKENDS[name]
    backend = getattr(importlib.import_module(module), cls)(device)
    logger.info("Using %s attention backend (device %s).", name, device)
    return backend
