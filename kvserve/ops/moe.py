"""The C++ fused-experts kernel for CPU decode steps (csrc/moe.cpp).

    fused_moe_cpu(x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k] float32,
                  topk_ids [T, k] int64) -> [T, H] in x's dtype

A decode step of a mixture-of-experts layer is a stream over the routed experts' weights: the
kernel groups the T * k (token, expert) pairs by expert and reads each routed expert's rows
once, gate_up GEMV -> SiLU * up -> down GEMV -> weighted sum in one call, the two cores on
disjoint output rows. Larger steps (prefill) run the grouped torch GEMMs instead
(model/layers/fused_moe/torch_moe.py): `kernel_takes` says which. dtypes: float32 x with
float32 or bfloat16 weights, bfloat16 x with bfloat16 weights (float32 math inside).
On CPUs with AVX-512 BF16, bf16 experts under bf16 math are kept panel-packed instead
(pack_panels, below; csrc/moe_panels.h): the same op then takes every step size.

    fused_moe_packed_cpu(x [T, H] f32, w13 [stacks], w13_types, w2, w2_type, inter,
                         topk_weights, topk_ids) -> [T, H] f32

GGUF experts kept packed (model/layers/fused_moe/packed.py): per routed expert the int8 kernel
kvserve::quant_linear on its blocks, grouped as above, in one call per layer.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from kvserve.ops.build import CpuKernel

# Largest T * k sent to the kernel: float32 math (and bf16 x on a tier without dpbf16, which
# the kernel widens), and bf16 x with bf16 weights on dpbf16. benchmarks/moe.py --kernel-sweep
# (the full 1B MoE's shapes, 16 experts, top-2; 2 threads, quiet Zen 5; weights from memory),
# kernel vs grouped torch GEMMs: float32 1.45-2.6x up to 64 pairs, 1.65x at 128, 1.14x at 256,
# 0.72x at 512; bf16 (dpbf16) 3.0-3.7x up to 64, 2.15x at 128, 1.66x at 256, 1.11x at 512.
# An expert with more pairs than one pass takes is streamed once (weight tiles, csrc/moe.cpp),
# which is what keeps the kernel ahead at 8-32 pairs an expert. The old single limit of 64 sent
# 64-sequence decode steps of that MoE to torch's GEMMs (bf16: 6.9 instead of 3.2 ms a layer);
# offline 64 prompts 214 -> 551 tok/s.
MAX_DECODE_PAIRS = 256
MAX_DECODE_PAIRS_DPBF16 = 512

_KERNEL = CpuKernel("moe.cpp", op="fused_moe", isa_op="fused_moe_isa",
                    what="fused MoE experts (decode)", fallback="grouped torch GEMMs")
cpu_kernel_isa: Callable[[], Optional[str]] = _KERNEL.isa
_enabled = True


@functools.lru_cache(maxsize=1)
def cpu_kernel() -> Optional[Callable[..., torch.Tensor]]:
    """The compiled op, or None (disabled, switched off, or the build failed). Looked up once
    per process (reset_dispatch): a model calls it once per MoE layer per step."""
    if not _enabled or _KERNEL.get() is None:
        return None
    return torch.ops.kvserve.fused_moe.default


def kernel_built() -> bool:
    """Whether the kernel's library is (or can be) loaded, switched on or not: the fused
    all-layers decode op calls it through the dispatcher (model/layers/fused_decode.py)."""
    return _KERNEL.get() is not None


def reset_dispatch() -> None:
    """The process's CPU settings changed: look the ops up again."""
    cpu_kernel.cache_clear()
    packed_kernel.cache_clear()
    max_decode_pairs.cache_clear()


def set_kernel_enabled(enabled: bool) -> None:
    """Switch the kernel on or off in this process (benchmarks compare both paths in one run);
    on still means "unless disable_cpu_kernels is set or the build failed"."""
    global _enabled
    _enabled = enabled
    reset_dispatch()


@functools.lru_cache(maxsize=4)
def max_decode_pairs(x_dtype: torch.dtype) -> int:
    """The largest T * k this kernel build takes for x of this dtype (the crossover with the
    grouped torch GEMMs, above). Cached: a model asks once per MoE layer per step."""
    dpbf16 = x_dtype == torch.bfloat16 and (cpu_kernel_isa() or "").startswith("avx512_bf16")
    return MAX_DECODE_PAIRS_DPBF16 if dpbf16 else MAX_DECODE_PAIRS


def kernel_takes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, num_pairs: int) -> bool:
    """Whether this step goes to the kernel: CPU, a decode-sized step (num_pairs = T * k up to
    max_decode_pairs), dtypes it has, contiguous weights. Panel-packed experts (pack_panels)
    take every step size (bf16 x)."""
    wt = w13.dtype
    if is_panel_packed(w13):
        return num_pairs > 0 and x.device.type == "cpu" and x.dtype == torch.bfloat16
    dtypes_ok = (wt == w2.dtype and (
        (x.dtype == torch.float32 and wt in (torch.float32, torch.bfloat16))
        or (x.dtype == torch.bfloat16 and wt == torch.bfloat16)))
    return (0 < num_pairs <= max_decode_pairs(x.dtype) and x.device.type == "cpu"
            and dtypes_ok and w13.is_contiguous() and w2.is_contiguous())


# ---------------------------------------------------------------- panel-packed bf16 experts
# csrc/moe_panels.h: each 16 output rows of an expert's matrix form a panel holding, for every
# input pair (x[2k], x[2k+1]), the 16 rows' two weights -- the operand order of AVX-512 BF16's
# dpbf16 with x broadcast, so a vector lane is an output row. gate and up panels of the same 16
# intermediates alternate in w13. On dpbf16 CPUs bf16 experts are kept this way (FusedMoE's
# choose_cpu_layout, from the loader's apply_weight_plan) and every step, prefill included, runs
# the C++ kernel:
# benchmarks/moe.py --kernel-sweep measured it against the row layout's kernel and torch's GEMMs.
PANEL_ROWS = 16


def is_panel_packed(w13: torch.Tensor) -> bool:
    return w13.dim() == 4


def panels_fit(w13: torch.Tensor, w2: torch.Tensor, math_dtype: torch.dtype) -> bool:
    """Whether these [E, 2I, H] / [E, H, I] experts should be kept panel-packed: bf16 weights
    and math on CPU, a kernel build with dpbf16, switched on, 16-row blocks."""
    _, two_i, h = w13.shape
    return (w13.numel() > 0 and w13.device.type == "cpu"
            and w13.dtype == w2.dtype == math_dtype == torch.bfloat16
            and two_i % (2 * PANEL_ROWS) == 0 and h % PANEL_ROWS == 0
            and (cpu_kernel_isa() or "").startswith("avx512_bf16") and cpu_kernel() is not None)


def pack_panels(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, 2I, H] (gate | up) and [E, H, I] -> w13 [E, 2I/16, H/2, 32] (gate and up panels
    alternating) and w2 [E, H/16, I/2, 32]: csrc/moe_panels.h's layout. Same values."""
    e, two_i, h = w13.shape
    i, r = two_i // 2, PANEL_ROWS
    w13p = (w13.reshape(e, 2, i // r, r, h // 2, 2).permute(0, 2, 1, 4, 3, 5)
            .reshape(e, two_i // r, h // 2, 2 * r).contiguous())
    w2p = (w2.reshape(e, h // r, r, i // 2, 2).permute(0, 1, 3, 2, 4)
           .reshape(e, h // r, i // 2, 2 * r).contiguous())
    return w13p, w2p


def unpack_panels(w13p: torch.Tensor, w2p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_panels' inverse: the [E, 2I, H] and [E, H, I] stacks (for the grouped torch path
    where the kernel is switched off after loading, and for tests)."""
    e, nb13, kp13, _ = w13p.shape
    _, nb2, kp2, _ = w2p.shape
    r, h, i = PANEL_ROWS, 2 * kp13, 2 * kp2
    w13 = (w13p.reshape(e, nb13 // 2, 2, kp13, r, 2).permute(0, 2, 1, 4, 3, 5)
           .reshape(e, 2 * i, h).contiguous())
    w2 = w2p.reshape(e, nb2, kp2, r, 2).permute(0, 1, 3, 2, 4).reshape(e, h, i).contiguous()
    return w13, w2


@functools.lru_cache(maxsize=1)
def packed_kernel() -> Optional[Callable[..., torch.Tensor]]:
    """The packed experts' op, or None: it calls kvserve::quant_linear and silu_and_mul
    through the dispatcher, so their libraries must be built and loaded too."""
    from kvserve.ops import fused
    from kvserve.ops.quant import kernel as quant_kernel

    if cpu_kernel() is None or fused._ops() is None or quant_kernel.ops() is None:
        return None
    return torch.ops.kvserve.fused_moe_packed.default


def fused_moe_packed_cpu(x: torch.Tensor, w13: list[torch.Tensor], w13_types: list[int],
                         w2: torch.Tensor, w2_type: int, inter: int, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """The packed experts' op (check packed_kernel() first). Stacks as PackedExperts.packed;
    ids in [0, E)."""
    op = packed_kernel()
    if op is None:
        raise RuntimeError("the C++ packed MoE op is not available (disabled or not built)")
    return op(x.float().contiguous(), w13, w13_types, w2, w2_type, inter,
              topk_weights.float().contiguous(), topk_ids.long().contiguous())


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The kernel's op (which must be built: check cpu_kernel() first)."""
    op = cpu_kernel()
    if op is None:
        raise RuntimeError("the C++ fused MoE kernel is not available (disabled or not built)")
    return op(x.contiguous(), w13, w2, topk_weights.float().contiguous(),
              topk_ids.long().contiguous())
