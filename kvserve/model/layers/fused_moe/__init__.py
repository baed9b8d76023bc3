"""Mixture-of-experts: router top-k (routing.py), the experts' grouped computation
(torch_moe.py; fused_moe.py dispatches to the C++ / Triton kernels) and the stacked,
tensor-parallel expert weights (layer.py)."""
from kvserve.model.layers.fused_moe.fused_moe import fused_experts
from kvserve.model.layers.fused_moe.layer import FusedMoE
from kvserve.model.layers.fused_moe.routing import select_experts
from kvserve.model.layers.fused_moe.torch_moe import fused_experts_torch

__all__ = ["FusedMoE", "fused_experts", "select_experts", "fused_experts_torch"]
