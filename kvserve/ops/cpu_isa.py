"""CPU ISA tiers for the C++ kernels, chosen at run time from the CPU's flags.

    generic      any x86-64 (SSE2 baseline): portable loops
    avx2         AVX2 + FMA + F16C: 8-lane float32, bf16/fp16 widened in registers
    avx512       + AVX-512 F/BW/VL/DQ
    avx512_bf16  + AVX512_BF16 (dpbf16 dot products, native bf16 rounding)

Each kernel is compiled per tier with that tier's explicit flags (never -march=native), so a
build is valid on every CPU of its tier and the on-disk cache is keyed by tier. The host's
best tier is used unless the engine config's `cpu_isa` (--cpu-isa) names a lower one (so an
AVX-512 machine can test and benchmark the AVX2 path); naming a tier the CPU lacks is an error. A
CPU that is not x86-64 (aarch64, ...) gets no tier: the torch fallbacks run instead.

The process's CPU settings (CpuSettings: tier, kernels on/off, huge pages) are the engine
config's CpuConfig, handed to every worker process by `configure`; a process no engine
configured (tests and benchmarks calling ops directly) takes the KVSERVE_CPU_* variables'
values, the same defaults the config's fields have.
"""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import Optional

from kvserve import envs

ISA_ENV = "KVSERVE_CPU_ISA"
# Ascending: each tier needs the flags of those before it.
TIERS = ("generic", "avx2", "avx512", "avx512_bf16")
_TIER_CPU_FLAGS = {
    "generic": frozenset(),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                              "avx512dq", "avx512_bf16"}),
}
_TIER_CFLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                    "-mavx512dq", "-mavx512bf16"],
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


ISA_CHOICES = ("auto", *TIERS)
HUGE_PAGES_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class CpuSettings:
    """What this process runs with on CPU (the engine config's CpuConfig)."""
    isa: str = "auto"               # "auto" (the host's best) or a tier of TIERS
    kernels_enabled: bool = True    # False: torch paths only, no C++ kernels, no oneDNN packing
    huge_pages: str = "auto"        # model.huge_pages: "auto" | "on" | "off"

    @staticmethod
    def from_env() -> "CpuSettings":
        """The KVSERVE_CPU_* variables' values (through kvserve.envs): the defaults."""
        pages = envs.get("KVSERVE_CPU_HUGE_PAGES")
        return CpuSettings(isa=envs.get(ISA_ENV) or "auto",
                           kernels_enabled=not envs.get("KVSERVE_DISABLE_CPU_KERNELS"),
                           huge_pages={"1": "on", "0": "off"}.get(pages, pages))


_configured: Optional[CpuSettings] = None


def configure(cpu: Optional[CpuSettings]) -> None:
    """This process's CPU settings from the engine config (each worker, before loading);
    None: back to the variables' values."""
    global _configured
    if cpu is not None:
        resolve_tier(cpu.isa)   # a tier the CPU lacks fails here, at start-up
    _configured = cpu


def settings() -> CpuSettings:
    """The configured settings; unconfigured, the variables' values now (not cached)."""
    return _configured if _configured is not None else CpuSettings.from_env()


def resolve_tier(isa: str = "auto") -> Optional[str]:
    """The tier `isa` means here: "auto" is the host's best; None off x86-64 (torch
    fallbacks). Raises ValueError for an unknown tier name or one this CPU cannot run."""
    tiers = supported_tiers()
    forced = (isa or "auto").strip().lower()
    if forced == "auto":
        return tiers[-1] if tiers else None
    if forced not in TIERS:
        raise ValueError(f"cpu_isa={forced!r} ({ISA_ENV}) is not a CPU ISA tier; use one of "
                         f"{', '.join(ISA_CHOICES)}.")
    if forced not in tiers:
        have = ", ".join(tiers) if tiers else f"none ({platform.machine()} is not x86-64)"
        raise ValueError(f"cpu_isa={forced} ({ISA_ENV}) asks for more than this CPU has: it "
                         f"supports {have}.")
    return forced


def selected_tier() -> Optional[str]:
    """The tier the kernels are built for (this process's settings)."""
    return resolve_tier(settings().isa)


def kernels_enabled() -> bool:
    """Whether kvserve's C++ kernels and oneDNN prepacking may be used (the one switch; read
    per call by the ops, so only the one variable when unconfigured)."""
    if _configured is not None:
        return _configured.kernels_enabled
    return not envs.get("KVSERVE_DISABLE_CPU_KERNELS")


def tier_cflags(tier: str) -> list[str]:
    """The compiler flags of a tier (on top of -O3 etc.)."""
    return list(_TIER_CFLAGS[tier])


def has_native_bf16(isa: Optional[str] = None) -> bool:
    """Whether the tier (`isa`, else this process's) has bf16 dot products (else bf16 math is
    emulated on CPU: widen to float32 instead)."""
    return (selected_tier() if isa is None else resolve_tier(isa)) == "avx512_bf16"
