"""Building kvserve's C++ CPU kernels: compiled on first use, cached on disk, never fatal.

Each kernel is one source in csrc/ that registers `torch.ops.kvserve.<op>` (plus an `<isa>` op
naming its vector path). A failed build (no compiler, no ninja, a compile error) logs why once
and returns None: callers then use their pure-torch path. KVSERVE_DISABLE_CPU_KERNELS=1 forces
that path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVSERVE_DISABLE_CPU_KERNELS"
# The dtypes every kernel (and oneDNN prepacking) handles; others take the torch paths.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
CSRC_DIR = Path(__file__).parent / "csrc"
# -march=native: a kernel is compiled on (and only for) the machine that runs it; the build
# directory's name includes the CPU's feature flags, so a cache shared between hosts is safe.
# -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]
# torch serialises builds with a lock file in the build directory and waits for it to vanish;
# a build killed outright (SIGKILL, OOM) leaves it behind and every later start would hang.
# A build takes 10-30 s here, so a lock this old is stale.
_STALE_LOCK_S = 600.0


def cpu_fingerprint() -> str:
    """What -march=native depends on: the ISA and its feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def build_dir(name: str) -> str:
    """$TORCH_EXTENSIONS_DIR/<name> if set, else the kvserve cache dir (as for the demo model:
    $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve)/torch_extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cache = os.environ.get("KVSERVE_CACHE_DIR")
        if cache:
            cache = os.path.expanduser(cache)
        else:
            home_cache = os.path.join(os.path.expanduser("~"), ".cache")
            cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or home_cache, "kvserve")
        root = os.path.join(cache, "torch_extensions")
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
        try:
            from torch.utils import cpp_extension

            key = b"\0".join([self.source.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(),
                              torch.__version__.encode(), cpu_fingerprint().encode()])
            name = f"kvserve_{self.source.stem}_{hashlib.sha256(key).hexdigest()[:16]}"
            directory = build_dir(name)
            _remove_stale_lock(os.path.join(directory, "lock"))
            t0 = time.perf_counter()
            cpp_extension.load(name=name, sources=[str(self.source)], extra_cflags=CFLAGS,
                               extra_ldflags=LDFLAGS, build_directory=directory,
                               is_python_module=False, verbose=False)
            op = getattr(torch.ops.kvserve, self.op)
            isa = getattr(torch.ops.kvserve, self.isa_op)()
            self._log_once("cpu", "%s: C++ CPU kernel (%s), ready in %.1f s",
                           self.what, isa, time.perf_counter() - t0)
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
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            self._log_once("disabled", "%s: %s (%s is set)", self.what, self.fallback, DISABLE_ENV)
            return None
        return self.load()

    def isa(self) -> Optional[str]:
        """The compiled kernel's vector path; None without a kernel."""
        return getattr(torch.ops.kvserve, self.isa_op)() if self.get() is not None else None
