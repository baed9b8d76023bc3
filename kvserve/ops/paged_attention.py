"""Paged decode attention: each sequence's one new query token against its paged KV cache.

    q             [N, H, D]            one query token per sequence
    kv_cache      [2, NB, BS, Hkv, D]  K = kv_cache[0], V = kv_cache[1]
    block_tables  [N, MB] int64        padded; row n's first ceil(seq_lens[n] / BS) ids are used
    seq_lens      [N] int64            tokens to attend to (including the new one), >= 1
    -> out        [N, H, D]            same dtype as q

Query head h reads kv head h // (H // Hkv), as Hugging Face's `repeat_kv` does.

Two implementations:
- a C++ CPU kernel (csrc/paged_attention.cpp), compiled on first use for the machine that runs
  it: one pass over each sequence's blocks with an online softmax, K/V read in place;
- a pure-torch path (gather + batched matmul) used on CUDA, for other dtypes, when the C++
  build fails, or when KVSERVE_DISABLE_CPU_KERNELS=1. It is also the reference the kernel
  is benchmarked against.
"""
from __future__ import annotations

import functools
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
_CSRC = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# -march=native: the kernel is compiled on (and only for) the machine that runs it; the build
# directory's name includes the CPU's feature flags, so a cache shared between hosts is safe.
# -fopenmp: at::parallel_for is an inline OpenMP region in torch's headers.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# torch serialises builds with a lock file in the build directory and waits for it to vanish;
# a build killed outright (SIGKILL, OOM) leaves it behind and every later start would hang.
# A build takes 10-30 s here, so a lock this old is stale.
_STALE_LOCK_S = 600.0

_load_lock = threading.Lock()
_logged: set[str] = set()


def _log_once(key: str, msg: str, *args: object, level: int = logging.INFO) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def _cpu_fingerprint() -> str:
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


def _build_dir(name: str) -> str:
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


@functools.lru_cache(maxsize=1)
def _load_cpu_kernel() -> Optional[Callable[..., torch.Tensor]]:
    """Compile (or reuse a cached build of) the C++ kernel; None if that fails for any reason."""
    try:
        from torch.utils import cpp_extension

        source = _CSRC.read_bytes()
        key = b"\0".join([source, " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
                          _cpu_fingerprint().encode()])
        name = f"kvserve_paged_attention_{hashlib.sha256(key).hexdigest()[:16]}"
        build_dir = _build_dir(name)
        _remove_stale_lock(os.path.join(build_dir, "lock"))
        t0 = time.perf_counter()
        cpp_extension.load(name=name, sources=[str(_CSRC)], extra_cflags=_CFLAGS,
                           extra_ldflags=_LDFLAGS, build_directory=build_dir,
                           is_python_module=False, verbose=False)
        op = torch.ops.kvserve.paged_decode_attention
        isa = torch.ops.kvserve.paged_attention_isa()
        _log_once("cpu", "paged decode attention: C++ CPU kernel (%s), ready in %.1f s",
                  isa, time.perf_counter() - t0)
        return op
    except Exception as e:  # no compiler, no ninja, build error: all fall back to torch
        # The build error's message is the whole build log; its error lines say why.
        lines = str(e).splitlines()
        why = [ln for ln in lines if "error" in ln.lower()][:5] or lines[:1]
        _log_once("cpu", "paged decode attention: C++ CPU kernel unavailable (%s); using the "
                  "torch implementation. %s", type(e).__name__, " | ".join(why),
                  level=logging.WARNING)
        return None


def cpu_kernel() -> Optional[Callable[..., torch.Tensor]]:
    """The compiled CPU op (built on the first call), or None if disabled or unavailable."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        _log_once("disabled", "paged decode attention: torch implementation (%s is set)",
                  DISABLE_ENV)
        return None
    with _load_lock:  # one build per process even if several threads ask at once
        return _load_cpu_kernel()


def cpu_kernel_isa() -> Optional[str]:
    """The compiled kernel's vector path ("avx512" or "generic"); None without a kernel."""
    return torch.ops.kvserve.paged_attention_isa() if cpu_kernel() is not None else None


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention over a paged KV cache (see the module docstring for shapes)."""
    if q.device.type == "cpu" and kv_cache.dtype in _KERNEL_DTYPES:
        op = cpu_kernel()
        if op is not None:
            qc = q if q.dtype == kv_cache.dtype else q.to(kv_cache.dtype)
            return op(qc, kv_cache, block_tables, seq_lens, float(scale)).to(q.dtype)
    else:
        _log_once(f"torch-{q.device.type}-{kv_cache.dtype}",
                  "paged decode attention: torch implementation for %s %s tensors",
                  q.device.type, kv_cache.dtype)
    return paged_decode_attention_torch(q, kv_cache, block_tables, seq_lens, scale)


def paged_decode_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """Pure-torch version: gather each sequence's K/V rows, then batched matmuls.

    The rows are gathered straight into kv-head-major order ([N, Hkv, L, D], one index_select
    per K and V): batched matmuls over the strided [N, L, Hkv, D] layout ran 5-10x slower on
    CPU, and a separate permute copy cost as much as the gather. Slots past seq_len (including
    padded table entries) may hold anything, NaN too, and 0 * NaN = NaN: they are pointed at
    the sequence's first slot (valid whenever seq_len >= 1) and their scores masked, instead
    of zeroing the gathered values in another pass."""
    n, h, d = q.shape
    _, nb, bs, hkv, _ = kv_cache.shape
    g = h // hkv
    pos = torch.arange(block_tables.shape[1] * bs, device=q.device)            # [L]
    valid = pos[None, :] < seq_lens.to(q.device)[:, None]                        # [N, L]
    slots = block_tables[:, pos // bs] * bs + pos % bs                           # [N, L]
    slots = torch.where(valid, slots, slots[:, :1])
    # Row (slot, kv head) of the cache seen as [NB * BS * Hkv, D], in (n, kv head, l) order.
    rows = slots[:, None, :] * hkv + torch.arange(hkv, device=q.device)[None, :, None]
    flat = kv_cache.view(2, nb * bs * hkv, d)
    keys = flat[0].index_select(0, rows.view(-1)).view(n, hkv, -1, d)           # [N, Hkv, L, D]
    values = flat[1].index_select(0, rows.view(-1)).view(n, hkv, -1, d)
    qg = q.reshape(n, hkv, g, d).to(keys.dtype)                                 # [N, Hkv, G, D]
    acc_dtype = torch.promote_types(keys.dtype, torch.float32)   # float64 stays float64
    scores = torch.matmul(qg, keys.transpose(-1, -2)).to(acc_dtype)             # [N, Hkv, G, L]
    scores.mul_(scale).masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)                                            # [N, Hkv, G, D]
    return out.reshape(n, h, d).to(q.dtype)
