"""CPU ISA tiers for the C++ kernels, chosen at run time from the CPU's flags.

    generic      any x86-64 (SSE2 baseline): portable loops
    avx2         AVX2 + FMA + F16C: 8-lane float32, bf16/fp16 widened in registers
    avx512       + AVX-512 F/BW/VL/DQ
    avx512_bf16  + AVX512_BF16 and AVX512_VNNI (dpbf16 and vpdpbusd dot products, native bf16
                 rounding; every CPU with BF16 has VNNI: Cooper Lake, Sapphire Rapids, Zen 4/5)

Each kernel is compiled per tier with that tier's explicit flags (never -march=native), so a
build is valid on every CPU of its tier and the on-disk cache is keyed by tier. The host's
best tier is used unless the engine config's `cpu_isa` (--cpu-isa) names a lower one (so an
AVX-512 machine can test and benchmark the AVX2 path); naming a tier the CPU lacks is an error. A
CPU that is not x86-64 (aarch64, ...) gets no tier: the torch fallbacks run instead.
"""
from __future__ import annotations

import functools
import platform
from typing import Any, Optional

from kvserve import envs

ISA_ENV = "KVSERVE_CPU_ISA"
# Ascending: each tier needs the flags of those before it.
TIERS = ("generic", "avx2", "avx512", "avx512_bf16")
_TIER_CPU_FLAGS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                              "avx512dq", "avx512_bf16", "avx512_vnni"}),
}
_TIER_CFLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512dq", "-mavx512bf16", "-mavx512vnni"],
}


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_tiers(flags: Optional[frozenset[str]] = None) -> list[str]:
    """The tiers this CPU can run, lowest first; [] off x86-64."""
    if not is_x86_64():
        return []
    flags = cpu_flags() if flags is None else flags
    return [t for t in TIERS if _TIER_CPU_FLAGS[t] <= flags]


# The engine config's CpuConfig, set by each worker (duck-typed: ops does not import the
# config); None (no engine: tests, benchmarks) reads the variables behind its defaults.
_configured: Any = None


def configure(cpu_config: Any) -> None:
    """This process's CPU settings (each worker, before loading; None: the variables'); the
    kernel lookups cached per process start again."""
    global _configured
    if cpu_config is not None:
        resolve_tier(cpu_config.cpu_isa)     # a tier the CPU lacks fails here, at start-up
    _configured = cpu_config
    from kvserve.ops import fused, linear, moe    # they import this module
    linear.reset_dispatch()
    fused.reset_dispatch()
    moe.reset_dispatch()


def resolve_tier(isa: Optional[str] = "auto") -> Optional[str]:
    """The tier `isa` means here: "auto" is the host's best; None off x86-64 (torch
    fallbacks). Raises ValueError for an unknown tier name or one this CPU cannot run."""
    tiers = supported_tiers()
    forced = (isa or "auto").strip().lower()
    if forced == "auto":
        return tiers[-1] if tiers else None
    if forced not in TIERS:
        raise ValueError(f"cpu_isa={forced!r} ({ISA_ENV}) is not a CPU ISA tier; use one of "
                         f"auto, {', '.join(TIERS)}.")
    if forced not in tiers:
        have = ", ".join(tiers) if tiers else f"none ({platform.machine()} is not x86-64)"
        raise ValueError(f"cpu_isa={forced} ({ISA_ENV}) asks for more than this CPU has: it "
                         f"supports {have}.")
    return forced


def selected_tier() -> Optional[str]:
    """The tier the kernels are built for (this process's cpu_isa)."""
    return resolve_tier(envs.get(ISA_ENV) if _configured is None else _configured.cpu_isa)


def kernels_enabled() -> bool:
    """Whether kvserve's C++ kernels and oneDNN prepacking may be used: the one switch."""
    if _configured is None:
        return not envs.get("KVSERVE_DISABLE_CPU_KERNELS")
    return not _configured.disable_cpu_kernels


def huge_pages_mode() -> str:
    """cpu_huge_pages: "auto" | "on" | "off" (model/huge_pages.py)."""
    return envs.get("KVSERVE_CPU_HUGE_PAGES") if _configured is None else _configured.cpu_huge_pages


def tier_cflags(tier: str) -> list[str]:
    """The compiler flags of a tier (on top of -O3 etc.)."""
    return list(_TIER_CFLAGS[tier])


def has_native_bf16() -> bool:
    """Whether the selected tier has bf16 dot products (else bf16 math is emulated on CPU:
    widen to float32 instead)."""
    return selected_tier() == "avx512_bf16"
