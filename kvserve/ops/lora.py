"""The multi-LoRA delta's C++ CPU kernel (csrc/lora.cpp): y[t] += B[slot(t)] (A[slot(t)] x[t]).

    y            [T, N]     x's dtype, rows contiguous; updated in place
    x            [T, K]     float32 | bfloat16
    a_stack      [S, R, K]  float32 | bfloat16 (bfloat16 also with float32 x)
    b_stack      [S, N, R]  a_stack's dtype; contiguous, or column-major per slot (a transposed
                            view of [S, R, N] storage: LoRALinear's, the faster expand)
    token_slots  [T]        int64 on the CPU, -1 = no adapter
    out_splits   [n] ints   a fused layer's output rows per slice (LoRALinear.out_splits): the
                            expand then skips B's zero blocks; () = read every column

At decode sizes the torch path (kvserve.lora.punica: two small GEMMs per adapter group, plus
an index_add when the group's tokens are not contiguous) is dominated by per-op dispatch;
the kernel does every group's shrink and expand in one call, streaming each adapter's A and
B once; prefill-sized calls run register tiles of each adapter's tokens over its A and B (one
GEMM per adapter segment, punica's SGMV). Up to CPU_KERNEL_MAX_TOKENS tokens (beyond any
default step) it runs, above that the torch path. Where the kernel cannot be used
(other dtypes, a failed build, KVSERVE_DISABLE_CPU_KERNELS) `fused_delta` returns False and
the caller runs the torch path.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch

from kvserve.ops import cpu_isa
from kvserve.ops.build import CpuKernel

# Largest token count sent to the kernel; torch's grouped GEMMs above. With column-major B (its
# expand an axpy over the rank) and a work pool of its own (since replaced by torch's OpenMP
# threads, see kMinMacsParallel in csrc/lora.cpp) the kernel beat them at every prompt size
# measured, and torch's OpenMP GEMMs stall on a shared CPU: one layer's delta of the 110M
# Llama (4 adapters, rank 16, 16 requests' tokens contiguous, EPYC Zen 3 2 cores at load 4-5,
# interleaved in one process; min / median ms) at 64 tokens 2.3 / 14 vs 13 / 94, at 128
# 9.1 / 18 vs 37 / 600, at 256 27 / 36 vs 154 / 227, at 640 37 / 56 vs 513 / 2817. Since its
# prefill-sized calls run register tiles of tokens (csrc/lora.cpp, kTiledMinTokens) it wins by
# 3-10x up to 4096 tokens too (gate_up / qkv of that Llama, 4 adapters, requests of 64-256
# tokens interleaved, load ~3, min ms; torch = LoRALinear's gather, grouped GEMMs, scatter):
# 2 threads at 2048 tokens 12.4 / 6.8 vs 172 / 112, at 4096 39 / 15 vs 385 / 203; one thread
# at 4096 22 / 15 vs 121 / 62. So the whole default token budget (8192) takes the kernel.
CPU_KERNEL_MAX_TOKENS = 16384
_KERNEL = CpuKernel("lora.cpp", op="lora_fused", isa_op="lora_isa",
                    what="multi-LoRA shrink+expand", fallback="the torch grouped matmuls")
cpu_kernel: Callable[[], Optional[Callable[..., None]]] = _KERNEL.get
cpu_kernel_isa: Callable[[], Optional[str]] = _KERNEL.isa
_enabled = True


@functools.lru_cache(maxsize=1)
def _op() -> Optional[Callable[..., None]]:
    # Looked up once per process: a decode step calls this once per LoRA layer.
    if not _enabled or _KERNEL.get() is None:
        return None
    return torch.ops.kvserve.lora_fused.default


def set_kernels_enabled(enabled: bool) -> None:
    """Switch the kernel on or off in this process (tests and benchmarks compare both)."""
    global _enabled
    _enabled = enabled
    _op.cache_clear()


reset_dispatch = _op.cache_clear


def kernel_enabled() -> bool:
    """The kernel is built, loaded and switched on (set_kernels_enabled, cpu_isa.configure)."""
    return cpu_isa.kernels_enabled() and _op() is not None


def stacks_take(act_dtype: torch.dtype, a_stack: torch.Tensor, b_stack: torch.Tensor) -> bool:
    """Whether the kernel takes these stacks for activations of act_dtype (kernel_takes'
    checks that do not depend on the step)."""
    return (a_stack.device.type == "cpu" and a_stack.dtype == b_stack.dtype
            and act_dtype in (torch.float32, torch.bfloat16)
            and (a_stack.dtype == act_dtype or a_stack.dtype == torch.bfloat16)
            and a_stack.is_contiguous() and (b_stack.is_contiguous() or b_col_major(b_stack)))


def b_col_major(b_stack: torch.Tensor) -> bool:
    """b_stack [S, N, R] is a transposed view of contiguous [S, R, N] storage."""
    s, n, r = b_stack.shape
    return b_stack.stride() == (n * r, 1, n)


def kernel_takes(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor,
                 b_stack: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (CPU, dtypes, layouts): this step's x and y,
    then the stacks' own checks (stacks_take)."""
    return (x.device.type == "cpu" and x.dim() == 2 and y.dim() == 2 and y.stride(1) == 1
            and y.dtype == x.dtype and x.is_contiguous()
            and stacks_take(x.dtype, a_stack, b_stack))


def fused_delta(y: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
                token_slots: torch.Tensor, out_splits: Sequence[int] = ()) -> bool:
    """y += the LoRA delta with the C++ kernel; False (y untouched) where it does not apply."""
    if x.shape[0] > CPU_KERNEL_MAX_TOKENS or not kernel_takes(y, x, a_stack, b_stack):
        return False
    # The switch is read per call (cheap): a worker's CPU settings may change it after the
    # first lookup (cpu_isa.configure).
    op = _op() if cpu_isa.kernels_enabled() else None
    if op is None:
        return False
    op(y, x, a_stack, b_stack, token_slots, out_splits)
    return True
