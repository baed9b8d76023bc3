"""Native memory settings each kvserve process applies to itself at start, so that a long-running
server's memory settles without the user knowing any allocator variables.

Two native caches grow with the variety of step shapes a server sees:
- glibc's heap: freed blocks under the *dynamic* mmap threshold stay in the heap. The threshold
  rises (up to 32 MiB on 64-bit) each time a large mmapped block is freed, so after a while
  every activation tensor is carved from the heap, and a fragmented heap is never given back.
  A fixed `M_MMAP_THRESHOLD` switches the dynamic rise off: 128 KiB while the model loads
  (large blocks in mmap, returned on free), 32 MiB once it serves (`serving_thresholds`: a
  step's activations reuse heap memory instead of page-faulting fresh mappings);
  `M_TRIM_THRESHOLD` likewise; `M_ARENA_MAX` bounds the per-thread arenas (the IO, grammar
  and tokenizer threads).
- oneDNN's primitive cache: up to 1024 compiled GEMM kernels by default, one per shape.
- ideep's (torch's oneDNN wrapper) own per-thread cache of prepared computations, used by the
  prepacked linears: also up to 1024 by default (`LRU_CACHE_CAPACITY`, read at its first use),
  about 0.28 MB each, one per (input shape, weight): +255 MB over 900 shapes, the engine
  core's +0.3 MB a request over its first ~2,000 requests (pytorch/pytorch#27971).

glibc reads `MALLOC_*` variables only when the process starts, so they cannot be set from
inside; `mallopt` can be called at any time and applies to what is allocated afterwards, which
is why this runs first thing in each entry point. oneDNN reads
`ONEDNN_PRIMITIVE_CACHE_CAPACITY` when it first creates a primitive (torch does not export its
setter), so the variable is set in `os.environ` before any model code runs; spawned children
inherit it and set it again themselves. A value the user set explicitly (any `MALLOC_*` of
these or the oneDNN variable) wins: that setting is left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

# mallopt parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

# Measured on the tiny test Llama (tests/entrypoints/test_soak.py's request mix, a new mix each
# pass of 500 requests, 6 passes, --max-num-seqs 16; shared 2-core Zen 3): the engine core's RSS
# above its start after 3,000 requests, and its growth over the last pass --
#   glibc and oneDNN defaults:                       +645 MB, last pass +31 MB
#   256 KiB thresholds, 4 arenas, 64 oneDNN entries:  +422 MB, last pass +9.6 MB
#   128 KiB thresholds, 4 arenas, 8 oneDNN entries:   +293 MB, last pass +1.7 MB
# with no measurable change in the soak's time (356 / 341 / 352 s, same load). 128 KiB keeps
# each weight tensor in its own mapping while a model loads (the temporaries of a load are
# given back, not left as holes in the heap). Once the process serves, `serving_thresholds`
# raises both to 32 MiB (glibc's own upper bound for its dynamic threshold, here fixed): at
# 128 KiB every prefill activation was a fresh mapping, faulted in and zeroed on first touch
# and unmapped on free, a few hundred MB of page faults a 2,048-token step. The 1B MoE
# (benchmarks/moe.py's full model, bf16) prefilled 128 prompts (9,069 tokens) in 8.1-8.6 s in
# the engine core process against 4.1 s in-process, 4.45-5.1 s at 32 MiB (Zen 5, 2 cores); the
# soak's engine core then grew +1.9 MB over 3,000 requests after its warm-up pass.
MMAP_THRESHOLD_BYTES = 128 * 1024
TRIM_THRESHOLD_BYTES = 128 * 1024
SERVING_THRESHOLD_BYTES = 32 << 20
ARENA_MAX = 4
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 8
# A step's linears share one input shape (a handful of weight shapes): 64 entries hold several
# steps' worth, at most ~18 MB.
IDEEP_LRU_CACHE_CAPACITY = 64

_MALLOPTS = (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
             ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
             ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENA_MAX))

_applied: Optional[str] = None
_owns_engine = False


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None   # musl and macOS have none
    except OSError:
        return None


def configure_process_memory(process_name: str, owns_engine: bool = False) -> str:
    """Apply the settings above to this process (once; later calls return the same summary)
    and log one line saying what was set. Returns that line. `owns_engine`: the process exists
    to run one engine core or worker until it exits (serving_thresholds then freezes the GC's
    start-up heap); not an API server, whose entry point a test may call in its own process."""
    global _applied, _owns_engine
    _owns_engine = _owns_engine or owns_engine
    if _applied is not None:
        return _applied
    parts: list[str] = []
    libc = _libc()
    for env_name, param, value in _MALLOPTS:
        if env_name in os.environ:
            parts.append(f"{env_name}={os.environ[env_name]} (from the environment)")
        elif libc is None:
            parts.append(f"{env_name} unset (no glibc mallopt)")
        elif libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1:
            parts.append(f"mallopt {env_name.strip('_').removeprefix('MALLOC_')}={value}")
        else:
            parts.append(f"mallopt {env_name} failed")
    for env_name, value, what in (
            ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE_CAPACITY,
             "oneDNN primitive cache"),
            ("LRU_CACHE_CAPACITY", IDEEP_LRU_CACHE_CAPACITY, "ideep computation cache")):
        # A spawned child inherits the parent's setting: ours, unless the values differ.
        inherited = os.environ.get(env_name)
        if inherited is not None and inherited != str(value):
            parts.append(f"{env_name}={inherited} (from the environment)")
        else:
            os.environ[env_name] = str(value)
            parts.append(f"{what} {value}")
    _applied = f"{process_name} memory settings: " + ", ".join(parts)
    logger.info(_applied)
    return _applied


def serving_thresholds(process_name: str) -> None:
    """The model is loaded: raise this process's malloc mmap / trim thresholds to
    SERVING_THRESHOLD_BYTES for the step-by-step allocations of serving (above). Not where
    the user set the variable, and not where configure_process_memory did not run.

    Also freezes the start-up heap (gc.collect, then gc.freeze, as vLLM's engine core does):
    the cyclic GC's full collections stop walking the model, tokenizer and config objects, 2.4%
    -> 1.2% of a demo decode step's perf samples (gc_collect_main, Zen 5). Only in an engine
    core or worker process (configure_process_memory's owns_engine), which lives as long as its
    engine: a frozen object is never collected, so an in-process engine dropped later (a test
    that ran `kvserve serve`'s entry point, then more engines) would keep its cycles."""
    if _applied is None:
        return
    if _owns_engine:
        gc.collect()
        gc.freeze()
    libc = _libc()
    if libc is None:
        return
    done = []
    for env_name, param in (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD),
                            ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD)):
        if env_name not in os.environ and \
                libc.mallopt(ctypes.c_int(param), ctypes.c_int(SERVING_THRESHOLD_BYTES)) == 1:
            done.append(env_name.strip("_").removeprefix("MALLOC_"))
    if done:
        logger.info("%s serves: malloc %s %d MiB", process_name, " and ".join(done),
                    SERVING_THRESHOLD_BYTES >> 20)


def release_freed_heap() -> None:
    """Give the heap's free pages back to the system (glibc malloc_trim(0); nothing without
    glibc). Where malloc's thresholds are glibc's dynamic ones (an in-process engine:
    configure_process_memory did not run), what a load freed (temporaries, the storages
    huge_pages replaced) were heap blocks whose pages stay resident: a 0.85B Q4_K_M model in
    process took 1359 MB of RSS after the move into huge pages, 799 MB once trimmed."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))
