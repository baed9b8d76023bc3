"""fused_experts: the one entry FusedMoE's forward calls (vLLM's name), dispatching by device
and step size.

    CUDA tensors           the Triton kernel (layers/fused_moe/triton_moe.py): tokens sorted by
                           expert into blocks, one tiled GEMM kernel for w13 and one for w2
    CPU, T * k small       the C++ kernel (kvserve/ops/moe.py, csrc/moe.cpp): only the routed
                           experts' weights streamed, once per step
    CPU, panel-packed      the C++ kernel for every step size (bf16 experts on dpbf16 CPUs,
                           ops/moe.py pack_panels)
    anything else          the grouped torch GEMMs (torch_moe.py): prefill-sized CPU steps,
                           other dtypes, kernels disabled (disable_cpu_kernels) or not built
"""
from __future__ import annotations

import torch

from kvserve.model.layers.fused_moe.torch_moe import fused_experts_torch
from kvserve.ops import moe as moe_ops


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H]; w13 [E, 2I, H] (gate | up), w2 [E, H, I]; topk_weights /
    topk_ids [T, k] -> [T, H] = sum over k of weight * down(silu(gate x) * up x)."""
    if hidden_states.is_cuda:
        from kvserve.model.layers.fused_moe.triton_moe import fused_experts_triton
        return fused_experts_triton(hidden_states, w13, w2, topk_weights, topk_ids)
    if (moe_ops.kernel_takes(hidden_states, w13, w2, topk_ids.numel())
            and moe_ops.cpu_kernel() is not None):
        return moe_ops.fused_moe_cpu(hidden_states, w13, w2, topk_weights, topk_ids)
    if moe_ops.is_panel_packed(w13):        # the kernel was switched off after loading
        w13, w2 = moe_ops.unpack_panels(w13, w2)
    return fused_experts_torch(hidden_states, w13, w2, topk_weights, topk_ids)
