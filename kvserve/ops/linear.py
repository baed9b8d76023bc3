"""Small-batch linear (matrix-vector) for CPU decode: out = x @ weight.T + bias.

    x       [..., K]  float32 | bfloat16
    weight  [N, K]    same dtype (nn.Linear layout)
    bias    [N]       optional
    -> out  [..., N]  same dtype

At decode batch sizes a linear layer is a stream over its weight, so its speed is the memory
bandwidth. torch's CPU matrix-vector path reaches about half of it here (../shared/PERF_NOTES.md:
11-15 GB/s in bfloat16, 19 GB/s in float32, of 28-35 GB/s), so for up to SMALL_BATCH_MAX_ROWS
rows a C++ kernel (csrc/linear.cpp: each weight row read once, AVX-512 dpbf16 / FMA, f32
accumulation) is used instead. Everything else goes to F.linear: more rows (where torch's
blocked GEMM wins), CUDA, other dtypes, a weight that is not contiguous, a failed build, or
KVSERVE_DISABLE_CPU_KERNELS=1.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# The build-cache helpers are shared with the paged attention kernel, so both builds live in
# the same cache directory and follow the same stale-lock rule.
from kvserve.ops.paged_attention import (DISABLE_ENV, _build_dir, _cpu_fingerprint,
                                         _remove_stale_lock)

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc" / "linear.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Largest row count linear() sends to the kernel. benchmarks/linear.py on the benchmark Llama's
# shapes (one thread): bf16 beats F.linear at every M <= 8 (1.1-3x), at M = 16 loses on two of
# five shapes (0.87-0.94x); f32 wins up to 16 (1.4-7x). One limit for both keeps it simple.
SMALL_BATCH_MAX_ROWS = 8

_load_lock = threading.Lock()
_logged: set[str] = set()


def _log_once(key: str, msg: str, *args: object, level: int = logging.INFO) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


@functools.lru_cache(maxsize=1)
def _load_cpu_kernel() -> Optional[Callable[..., torch.Tensor]]:
    """Compile (or reuse a cached build of) the C++ kernel; None if that fails for any reason."""
    try:
        from torch.utils import cpp_extension

        source = _CSRC.read_bytes()
        key = b"\0".join([source, " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
                          _cpu_fingerprint().encode()])
        name = f"kvserve_linear_{hashlib.sha256(key).hexdigest()[:16]}"
        build_dir = _build_dir(name)
        _remove_stale_lock(os.path.join(build_dir, "lock"))
        t0 = time.perf_counter()
        cpp_extension.load(name=name, sources=[str(_CSRC)], extra_cflags=_CFLAGS,
                           extra_ldflags=_LDFLAGS, build_directory=build_dir,
                           is_python_module=False, verbose=False)
        op = torch.ops.kvserve.small_batch_linear
        isa = torch.ops.kvserve.small_batch_linear_isa()
        _log_once("cpu", "small-batch linear: C++ CPU kernel (%s), ready in %.1f s",
                  isa, time.perf_counter() - t0)
        return op
    except Exception as e:  # no compiler, no ninja, build error: all fall back to torch
        lines = str(e).splitlines()
        why = [ln for ln in lines if "error" in ln.lower()][:5] or lines[:1]
        _log_once("cpu", "small-batch linear: C++ CPU kernel unavailable (%s); using F.linear. %s",
                  type(e).__name__, " | ".join(why), level=logging.WARNING)
        return None


def cpu_kernel() -> Optional[Callable[..., torch.Tensor]]:
    """The compiled CPU op (built on the first call), or None if disabled or unavailable."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        _log_once("disabled", "small-batch linear: F.linear (%s is set)", DISABLE_ENV)
        return None
    with _load_lock:  # one build per process even if several threads ask at once
        return _load_cpu_kernel()


def cpu_kernel_isa() -> Optional[str]:
    """The compiled kernel's vector paths, e.g. "avx512 (f32 fma, bf16 dpbf16)"; None without."""
    return torch.ops.kvserve.small_batch_linear_isa() if cpu_kernel() is not None else None


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    return (x.device.type == "cpu" and x.dim() == 2 and weight.dtype in _KERNEL_DTYPES
            and x.dtype == weight.dtype and weight.is_contiguous()
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())))


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] with the C++ kernel when it applies
    (CPU, float32/bfloat16, same dtypes, contiguous weight and bias), else F.linear.
    Any M works; the kernel is meant for M <= SMALL_BATCH_MAX_ROWS."""
    if _kernel_applies(x, weight, bias):
        op = cpu_kernel()
        if op is not None:
            return op(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


@functools.lru_cache(maxsize=1)
def _dispatch_kernel() -> Optional[Callable[..., torch.Tensor]]:
    # linear() runs ~50 times per decode step: the environment and the build are looked up
    # once per process (cpu_kernel() on every call cost ~4 us of the wrapper's ~6).
    return cpu_kernel()


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Drop-in for F.linear(x, weight, bias) (x [..., K] -> [..., N]): up to
    SMALL_BATCH_MAX_ROWS rows on CPU go to the C++ kernel, everything else to F.linear."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if 0 < rows <= SMALL_BATCH_MAX_ROWS:
        x2 = x.reshape(rows, k)
        if _kernel_applies(x2, weight, bias):
            op = _dispatch_kernel()
            if op is not None:
                out = op(x2.contiguous(), weight, bias)
                return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
