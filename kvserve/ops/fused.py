"""Fused elementwise ops of the decoder layer (RMSNorm, rotary, SiLU-and-mul, KV-cache write).

    rms_norm(x [..., D], weight [D], eps)                  -> out [..., D]
    fused_add_rms_norm(x, residual, weight, eps)           -> (rms_norm(x + residual), x + residual)
    rotary_embedding(positions [T], q [T, Hq*D], k [T, Hk*D], head_size, cos_cache, sin_cache)
                                                           -> (q, k) rotated (neox style)
    silu_and_mul(x [..., 2I])                              -> silu(x[..., :I]) * x[..., I:]
    silu_and_mul_linear(x [T, 2I], w [N, I])               -> silu_and_mul(x) @ w.T, or None
                                                              (CUDA batch-1 only: one kernel)
    reshape_and_cache(k, v [T, Hkv, D], kv_cache [2, NB, BS, Hkv, D], slot_mapping [T])

At decode batch sizes each of these is a handful of tiny torch ops (RMSNorm alone is eight)
whose cost is dispatch, not arithmetic; a decode step runs ~60 of them. On CPU they go to one
C++ kernel each (csrc/fused.cpp: one pass, AVX-512, same arithmetic and bf16 rounding points as
the torch code). The `*_torch` functions are that torch code, used on CUDA, for other dtypes,
when the build fails or the kernels are disabled (and as the tests' reference).

In-place: with the kernel, fused_add_rms_norm overwrites x (with the output) and residual (with
the sum), and rotary_embedding rotates q and k in place; the torch path returns new tensors.
Callers use the returned tensors and must not rely on the inputs either way.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.nn.functional as F

from kvserve.ops.build import KERNEL_DTYPES, CpuKernel

_KERNEL = CpuKernel("fused.cpp", op="rms_norm", isa_op="fused_isa",
                    what="fused norm/rotary/silu/cache-write ops", fallback="torch ops")
cpu_kernel = _KERNEL.get
cpu_kernel_isa = _KERNEL.isa
_enabled = True


@functools.lru_cache(maxsize=1)
def _ops() -> Optional[SimpleNamespace]:
    # The environment and the build are looked up once per process: these wrappers run ~60
    # times per decode step. The OpOverloads (`.default`) skip torch.ops' overload resolution.
    if not _enabled or _KERNEL.get() is None:
        return None
    ns = torch.ops.kvserve
    return SimpleNamespace(rms_norm=ns.rms_norm.default,
                           fused_add_rms_norm=ns.fused_add_rms_norm.default,
                           rotary_embedding=ns.rotary_embedding.default,
                           silu_and_mul=ns.silu_and_mul.default,
                           reshape_and_cache=ns.reshape_and_cache.default)


def set_kernels_enabled(enabled: bool) -> None:
    """Switch this module's kernels on or off in this process (to compare both paths in one
    run). On still means "unless disable_cpu_kernels is set or the build failed"."""
    global _enabled
    _enabled = enabled
    _ops.cache_clear()


reset_dispatch = _ops.cache_clear      # the process's CPU settings changed: look up again


def _triton() -> Any:
    """The CUDA path's fused Triton kernels (imported on first use: CPU runs never need them)."""
    from kvserve.ops.triton import fused
    return fused


def kernels_active() -> bool:
    """Whether the C++ kernels are in use (enabled, built, not disabled by the environment)."""
    return _ops() is not None


# ------------------------------------------------------------------------------------------
# RMSNorm (Hugging Face's LlamaRMSNorm: float32 inside, the weight multiply in the model dtype)

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (see rms_norm_torch for the arithmetic)."""
    if x.is_cuda and weight.dtype is x.dtype:
        return _triton().rms_norm(x, weight, eps)
    ops = _ops()
    if ops is not None and x.is_cpu and x.dtype in KERNEL_DTYPES and weight.dtype is x.dtype:
        return ops.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual     # in the model dtype, as HF adds the residual
    return rms_norm_torch(x, weight, eps), x


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). The kernel works in place: x becomes the
    output and residual the sum (same shapes and dtype required, else the torch path).
    On CUDA one Triton kernel does both."""
    if x.is_cuda and residual.dtype is x.dtype and weight.dtype is x.dtype:
        return _triton().fused_add_rms_norm(x, residual, weight, eps)
    ops = _ops()
    if (ops is not None and x.is_cpu and x.dtype in KERNEL_DTYPES and residual.dtype is x.dtype
            and weight.dtype is x.dtype):
        ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    return fused_add_rms_norm_torch(x, residual, weight, eps)


# ------------------------------------------------------------------------------------------
# Rotary embedding, neox style (HF Llama's rotate_half)

def rotary_embedding_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           head_size: int, cos_cache: torch.Tensor, sin_cache: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)    # [T, 1, D/2]
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, cos, sin, head_size), _rotate(k, cos, sin, head_size)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1);
    # written per half it is the same arithmetic, bit for bit.
    shape = x.shape
    x1, x2 = x.view(shape[0], -1, head_size).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).view(shape)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*D] and k [T, Hk*D] (or [T, H, D]) at `positions` [T] with the float32
    tables cos/sin_cache [max_position, D/2]. The kernel rotates q and k in place."""
    if q.is_cuda and k.dtype is q.dtype and cos_cache.dtype is torch.float32:
        return _triton().rotary_embedding(positions, q, k, head_size, cos_cache, sin_cache)
    ops = _ops()
    if (ops is not None and q.is_cpu and q.dtype in KERNEL_DTYPES and k.dtype is q.dtype
            and cos_cache.dtype is torch.float32):
        ops.rotary_embedding(positions, q, k, head_size, cos_cache, sin_cache)
        return q, k
    return rotary_embedding_torch(positions, q, k, head_size, cos_cache, sin_cache)


# ------------------------------------------------------------------------------------------
# SiLU-and-mul (the gated MLP's activation)

def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = gate | up -> silu(gate) * up [..., I]."""
    if x.is_cuda:
        return _triton().silu_and_mul(x)
    ops = _ops()
    if ops is not None and x.is_cpu and x.dtype in KERNEL_DTYPES:
        return ops.silu_and_mul(x)
    return silu_and_mul_torch(x)


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> Optional[torch.Tensor]:
    """silu_and_mul(x) @ weight.T as one kernel where that is the faster way: CUDA, a batch-1
    step, a plain weight in x's dtype (the Triton GEMV; cuBLAS's split-K GEMM needs the
    activation kernel, the GEMM and a reduce). None elsewhere: the caller runs the two ops."""
    if not (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and weight.dtype is x.dtype):
        return None
    tri = _triton()
    if x.shape[0] > tri.SILU_LINEAR_MAX_ROWS:
        return None
    return tri.silu_and_mul_linear(x, weight)


# ------------------------------------------------------------------------------------------
# KV-cache write

def reshape_and_cache_torch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> None:
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """kv_cache[0 / 1] at slot s = slot_mapping[t] (block s // BS, offset s % BS) = k[t] / v[t];
    k, v [T, Hkv, D], kv_cache [2, num_blocks, BS, Hkv, D], slot_mapping [T] int64."""
    ops = _ops()
    if ops is not None and kv_cache.is_cpu and kv_cache.dtype in KERNEL_DTYPES:
        ops.reshape_and_cache(k, v, kv_cache, slot_mapping)
        return
    reshape_and_cache_torch(k, v, kv_cache, slot_mapping)
