"""Rotary position embedding (neox style: rotate the two halves of each head, like HF Llama).

cos/sin for every position up to max_position are computed once in float32; a forward indexes
them by `positions` [T], so tokens of different requests at different positions rotate in one
call (kvserve.ops.fused.rotary_embedding: a C++ kernel on CPU, else torch ops).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from kvserve.ops.fused import rotary_embedding


def rope_config(hf_config: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from a config.json in either layout.

    transformers < 5 writes `rope_theta` + `rope_scaling`; transformers >= 5 writes one
    `rope_parameters` dict holding `rope_theta` and `rope_type` plus the scaling fields.
    """
    params = hf_config.get("rope_parameters")
    if params:
        theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(hf_config.get("rope_theta", 10000.0))
        scaling = hf_config.get("rope_scaling")
    if scaling is not None and _rope_type(scaling) == "default":
        scaling = None
    return theta, scaling


def _rope_type(scaling: dict) -> str:
    return scaling.get("rope_type") or scaling.get("type") or "default"


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_position: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths / factor, short kept, smooth in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling.get("original_max_position_embeddings") or max_position)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, base: float = 10000.0,
                 rope_scaling: Optional[dict[str, Any]] = None) -> None:
        super().__init__()
        self.head_size = head_size
        rope_type = _rope_type(rope_scaling) if rope_scaling else "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"Unsupported rope_scaling type {rope_type!r}; kvserve supports "
                             f"'default' and 'llama3'.")
        # Same arithmetic as HF (int64 arange -> float32) so the tables agree bit for bit.
        exponent = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        inv_freq = 1.0 / (base ** exponent)
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_size / 2]: HF's tables repeat these twice along the head.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq*D], k [T, Hk*D] (or already [T, H, D]) -> rotated, same shapes.
        The kernel rotates q and k in place; use the returned tensors."""
        return rotary_embedding(positions, q, k, self.head_size, self.cos_cache, self.sin_cache)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.cos_cache.shape[0]}"


def get_rope(head_size: int, hf_config: dict) -> RotaryEmbedding:
    """The rotary embedding a Llama-family config.json asks for."""
    theta, scaling = rope_config(hf_config)
    partial = float(hf_config.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported.")
    max_position = int(hf_config.get("max_position_embeddings") or 2048)
    return RotaryEmbedding(head_size, max_position, theta, scaling)
