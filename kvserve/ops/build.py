"""Building kvserve's C++ CPU kernels: compiled on first use, cached on disk, never fatal.

Each kernel is one source in csrc/ that registers `torch.ops.kvserve.<op>` (plus an `<isa>` op
naming its vector path). It is compiled for the ISA tier of cpu_isa.selected_tier() with that
tier's explicit flags and cached on disk per (source, headers, flags, torch, tier). Where no
kernel can be built at all (no C++ compiler or ninja, a CPU that is not x86-64) ONE warning says
so for all kernels; a failed build (a compile error) logs why once per kernel. Either way the
op is None and callers use their pure-torch path. `disable_cpu_kernels` (cpu_isa.kernels_enabled)
forces that path.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from kvserve import envs
from kvserve.ops import cpu_isa

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVSERVE_DISABLE_CPU_KERNELS"
# The dtypes every kernel (and oneDNN prepacking) handles; others take the torch paths.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
CSRC_DIR = Path(__file__).parent / "csrc"
# The ISA flags come from the tier (cpu_isa.tier_cflags), never -march=native: a build then runs
# on every CPU of its tier, and a cache shared between hosts is keyed by tier.
# -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers.
CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]
# torch serialises builds with a lock file in the build directory and waits for it to vanish;
# a build killed outright (SIGKILL, OOM) leaves it behind and every later start would hang.
# A build takes 10-30 s here, so a lock this old is stale.
_STALE_LOCK_S = 600.0


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> Optional[str]:
    """Why no kernel can be built in this process (None if they can): checked once, before
    any compile, so that a missing compiler gives one warning rather than one per kernel."""
    if not cpu_isa.is_x86_64():
        return f"no kernels for this CPU ({platform.machine()}; they are built for x86-64)"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found; set CXX)"
    from torch.utils import cpp_extension
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@functools.lru_cache(maxsize=1)
def _warn_unavailable_once(why: str) -> None:
    logger.warning("C++ CPU kernels unavailable: %s. Every kernel uses its torch fallback "
                   "(correct, slower).", why)


def build_dir(name: str) -> str:
    """$TORCH_EXTENSIONS_DIR/<name> if set, else kvserve's cache dir (envs.cache_dir(), as
    for the demo model)/torch_extensions/<name>."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(envs.cache_dir(),
                                                                 "torch_extensions")
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path


def _remove_stale_lock(lock: str) -> None:
    try:
        if time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
            logger.warning("removing the stale build lock %s (a build was killed?)", lock)
            os.remove(lock)
    except OSError:  # no lock (the usual case), or another process removed it first
        pass


class CpuKernel:
    """One compiled op: `get()` returns `torch.ops.kvserve.<op>` or None (disabled / failed)."""

    def __init__(self, source: str, op: str, isa_op: str, what: str, fallback: str) -> None:
        self.source = CSRC_DIR / source
        self.op, self.isa_op = op, isa_op
        self.what, self.fallback = what, fallback
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._loaded = False    # per instance: loading a library twice aborts the process
        self._op: Optional[Callable[..., torch.Tensor]] = None

    def _log_once(self, key: str, msg: str, *args: object, level: int = logging.INFO) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.log(level, msg, *args)

    def load(self) -> Optional[Callable[..., torch.Tensor]]:
        """Compile (or reuse a cached build of) the kernel, whatever the environment says."""
        with self._lock:   # one build per process even if several threads ask at once
            if not self._loaded:
                self._op = self._build()
                self._loaded = True
            return self._op

    def _build(self) -> Optional[Callable[..., torch.Tensor]]:
        why_not = unavailable_reason()
        if why_not is not None:
            _warn_unavailable_once(why_not)
            return None
        tier = cpu_isa.selected_tier()     # ValueError for a bad cpu_isa: not caught
        assert tier is not None            # x86-64 always has one
        try:
            from torch.utils import cpp_extension

            cflags = CFLAGS + cpu_isa.tier_cflags(tier)
            headers = [h.read_bytes() for h in sorted(CSRC_DIR.glob("*.h"))]
            key = b"\0".join([self.source.read_bytes(), *headers,
                              " ".join(cflags + LDFLAGS).encode(), torch.__version__.encode(),
                              platform.machine().encode()])
            name = f"kvserve_{self.source.stem}_{tier}_{hashlib.sha256(key).hexdigest()[:16]}"
            directory = build_dir(name)
            _remove_stale_lock(os.path.join(directory, "lock"))
            t0 = time.perf_counter()
            # Copies: cpp_extension.load appends to the lists it is given, which would change
            # the next kernel's cache key (and rebuild it) if LDFLAGS itself were passed.
            cpp_extension.load(name=name, sources=[str(self.source)], extra_cflags=list(cflags),
                               extra_ldflags=list(LDFLAGS), build_directory=directory,
                               is_python_module=False, verbose=False)
            op = getattr(torch.ops.kvserve, self.op)
            isa = getattr(torch.ops.kvserve, self.isa_op)()
            self._log_once("cpu", "%s: C++ CPU kernel, tier %s (%s), ready in %.1f s",
                           self.what, tier, isa, time.perf_counter() - t0)
            return op
        except Exception as e:  # no compiler, no ninja, build error: all fall back to torch
            # The build error's message is the whole build log; its error lines say why.
            lines = str(e).splitlines()
            why = [ln for ln in lines if "error" in ln.lower()][:5] or lines[:1]
            self._log_once("cpu", "%s: C++ CPU kernel unavailable (%s); using %s. %s",
                           self.what, type(e).__name__, self.fallback, " | ".join(why),
                           level=logging.WARNING)
            return None

    def get(self) -> Optional[Callable[..., torch.Tensor]]:
        """The compiled op (built on the first call), or None if disabled or unavailable."""
        if not cpu_isa.kernels_enabled():
            self._log_once("disabled", "%s: %s (disable_cpu_kernels)", self.what, self.fallback)
            return None
        return self.load()

    def isa(self) -> Optional[str]:
        """The compiled kernel's vector path; None without a kernel."""
        return getattr(torch.ops.kvserve, self.isa_op)() if self.get() is not None else None

    def run_attention(self, q: torch.Tensor, kv_cache: torch.Tensor,
                      *args: Any) -> Optional[torch.Tensor]:
        """The attention op on (q in kv_cache's dtype, kv_cache, *args), in q's dtype; None
        where it cannot run (not CPU, another dtype, no kernel): the caller's torch path."""
        if not q.is_cpu or kv_cache.dtype not in KERNEL_DTYPES:
            self._log_once(f"torch-{q.device.type}-{kv_cache.dtype}",
                           "%s: torch implementation for %s %s tensors", self.what,
                           q.device.type, kv_cache.dtype)
            return None
        op = self.get()
        if op is None:
            return None
        qc = q if q.dtype == kv_cache.dtype else q.to(kv_cache.dtype)
        return op(qc, kv_cache, *args).to(q.dtype)
