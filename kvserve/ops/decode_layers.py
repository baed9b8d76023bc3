"""All decoder layers of a step in one C++ call (csrc/decode_layers.cpp): a small step (T <=
ops.linear.small_batch_max_rows tokens), or any step where every projection keeps a prepacked
oneDNN copy (FusedDecodeStack.max_rows).

    decode_layers(hidden [T, hidden], residual [T, hidden] | None, positions [T],
                  layer_tensors (SLOTS per layer), kv_caches, slot_mapping, num_decode_tokens,
                  decode_block_tables, decode_seq_lens, prefill_query_starts, prefill_query_lens,
                  prefill_context_lens, prefill_block_tables (CPU_ATTN's metadata; None where
                  the step has no decodes / no prefill chunks), cos_cache, sin_cache, num_heads,
                  num_kv_heads, head_dim, scale, eps, lora_tensors (LORA_SLOTS per layer, or
                  [] for a step without adapter tokens), lora_slots ([T] int64 token -> slot,
                  -1 = base; None without adapters), quant_parts, quant_meta (packed GGUF
                  weights: QUANT_PARTS tensors per projection per layer and a (GGML type,
                  rows) pair each; [] and [] where every projection is a float weight),
                  onednn_above (steps of more rows run a projection's prepacked copy)
        -> (hidden, residual) after the last layer

The op runs the same kernels as the layer-by-layer path (small_batch_linear, the fused norm /
rotary / cache-write / silu ops, paged decode and prefill attention), in the same order, so its output is
bit-identical; what it removes is the Python between them, a third of a batch-1 decode step
on a 2-core AVX2 EPYC. kvserve.model.layers.fused_decode decides when a model can use it.
Multi-LoRA steps add each projection's adapter delta with the lora_fused kernel (csrc/lora.cpp,
through the dispatcher, as LoRALinear.apply does on the layer path): ops.lora.kernel_enabled().
Mixture-of-experts layers call the router's linear, select_experts' torch ops and the fused_moe
kernel (csrc/moe.cpp) in their MLP's place (FusedMoE's path for steps of this size).
Packed GGUF weights (ops.quant) run through kvserve::quant_linear as PackedWeight.matmul runs
them.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from kvserve.ops.build import CpuKernel

# The dense projections' prepacked oneDNN copies (None where a weight has none), run for steps
# of more than onednn_above rows (ops.linear.onednn_above_rows).
PREPACKED_SLOTS = ("qkv_p", "o_p", "gate_up_p", "down_p")
# Per-layer tensor slots, in csrc/decode_layers.cpp's order.
SLOTS = ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
         "down_w", "down_b", "q_norm", "k_norm",
         # Mixture-of-experts layers (None in dense ones; gate_up / down None in MoE ones):
         # router, FusedMoE's w13 / w2 stacks, [top_k, renormalise] int64, Qwen2-MoE's shared
         # expert (gate_up, down, its sigmoid gate).
         "router_w", "w13", "w2", "moe_cfg", "shared_gate_up_w", "shared_down_w",
         "shared_gate_w", *PREPACKED_SLOTS)
# Per-layer LoRA slots: per projection its LoRALinear's a_stack, b_stack and has_mask.
LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")
LORA_SLOTS = tuple(f"{p}_{t}" for p in LORA_PROJECTIONS for t in ("a", "b", "has"))
# Packed GGUF weights: parts per projection (LORA_PROJECTIONS' order; a fused q|k|v of three
# GGUF types is three), and the quant_meta type of a float part / of no part.
QUANT_PARTS = 3
FLOAT_PART, NO_PART = -1, -2

_KERNEL = CpuKernel("decode_layers.cpp", op="decode_layers", isa_op="decode_layers_isa",
                    what="fused decode layers", fallback="the layer-by-layer path")


def _dependencies_loaded() -> bool:
    # The op calls these kernels through the dispatcher: their libraries must be loaded.
    from kvserve.ops import fused, linear, paged_attention, prefill_attention
    return (fused.kernels_active() and linear.cpu_kernel() is not None
            and paged_attention.cpu_kernel() is not None
            and prefill_attention.cpu_kernel() is not None)


def decode_layers_op() -> Optional[Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """The compiled op (with the kernels it calls), or None: a kernel unavailable or disabled
    (disable_cpu_kernels)."""
    if not _dependencies_loaded():
        return None
    op = _KERNEL.get()
    return torch.ops.kvserve.decode_layers.default if op is not None else None
