"""kvserve's environment variables: the one table, and the one place that reads them.

Every `KVSERVE_*` variable is declared here once (name, parser, default, doc) and read through
`get(name)` (or `kvserve.envs.NAME`, the same call). No other module reads `os.environ` for a
`KVSERVE_*` name: a test (tests/test_envs.py) scans the package for that. User-facing choices
(CPU kernels, tiers, huge pages) are engine-config fields with flags shown by `--help`; the
variables they keep are only those fields' defaults, read once when the config is built.

One parsing rule per type:
- bool: 1/0, true/false, yes/no, on/off (any case); anything else is a ValueError naming the
  variable, so a typo fails where it is read instead of passing silently;
- float / int: Python's own parse, a ValueError naming the variable otherwise;
- choice: one of the listed words (any case), a ValueError listing them otherwise;
- str: as set (surrounding spaces stripped); an empty value counts as unset.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str                      # "bool" | "float" | "int" | "str" | "choice"
    default: Any
    doc: str
    choices: Sequence[str] = ()

    def parse(self, raw: str) -> Any:
        value = raw.strip()
        if self.kind == "bool":
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
            raise ValueError(f"{self.name} must be one of 1/0/true/false/yes/no/on/off, "
                             f"got {raw!r}")
        if self.kind in ("float", "int"):
            try:
                return float(value) if self.kind == "float" else int(value)
            except ValueError:
                raise ValueError(f"{self.name} must be a number, got {raw!r}") from None
        if self.kind == "choice":
            if value.lower() not in self.choices:
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}, "
                                 f"got {raw!r}")
            return value.lower()
        return value


def _var(name: str, kind: str, default: Any, doc: str,
         choices: Sequence[str] = ()) -> EnvVar:
    return EnvVar(name, kind, default, doc, tuple(choices))


ENV_VARS: dict[str, EnvVar] = {v.name: v for v in (
    # Where things are kept.
    _var("KVSERVE_CACHE_DIR", "str", None,
         "Cache directory (the demo model, compiled kernels); default "
         "$XDG_CACHE_HOME/kvserve or ~/.cache/kvserve."),
    # Serving.
    _var("KVSERVE_API_KEY", "str", None,
         "Default of `--api-key`: require 'Authorization: Bearer <key>' on /v1/*."),
    _var("KVSERVE_KEEP_ALIVE_ON_ENGINE_DEATH", "bool", False,
         "Keep the API server up (answering 503) when its engine dies, instead of exiting."),
    _var("KVSERVE_ENABLE_MULTIPROCESSING", "bool", True,
         "Run the engine core in its own process (0: in the API/LLM process)."),
    _var("KVSERVE_ALLOW_RUNTIME_LORA_UPDATING", "bool", False,
         "Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
         "VLLM_ALLOW_RUNTIME_LORA_UPDATING)."),
    _var("KVSERVE_TEST_LORA_TP", "bool", False,
         "Tests: also run the multi-LoRA test with tensor_parallel_size=2 (two worker "
         "processes; slow on 2 cores)."),
    _var("KVSERVE_HOLD_OUTPUTS", "bool", True,
         "Coalesce engine outputs a client has not read yet (the output coalescer)."),
    # Start-up and distributed timeouts (seconds).
    _var("KVSERVE_ENGINE_STARTUP_TIMEOUT", "float", 600.0,
         "Seconds to wait for engine cores to report ready."),
    _var("KVSERVE_DP_HANDSHAKE_TIMEOUT", "float", 60.0,
         "Seconds a data-parallel engine waits for the front node (and the front for remote "
         "engines) to say HELLO."),
    _var("KVSERVE_WORKER_READY_TIMEOUT_S", "float", 600.0,
         "Seconds to wait for TP/PP worker processes to report ready."),
    _var("KVSERVE_RAY_PG_TIMEOUT_S", "float", 120.0,
         "Seconds to wait for a Ray placement group."),
    _var("KVSERVE_PP_LAYER_PARTITION", "str", None,
         "Layers per pipeline stage, 'a,b,...' (default: an even split)."),
    # CPU kernels: the defaults of the engine config's CpuConfig fields (--cpu-isa,
    # --disable-cpu-kernels, --cpu-huge-pages), read when the config is built.
    _var("KVSERVE_CPU_ISA", "choice", None,
         "Default of --cpu-isa: build the CPU kernels for this ISA tier instead of the host's "
         "best.", ("auto", "generic", "avx2", "avx512", "avx512_bf16")),
    _var("KVSERVE_DISABLE_CPU_KERNELS", "bool", False,
         "Default of --disable-cpu-kernels: the pure-torch paths instead of kvserve's C++ "
         "kernels and oneDNN prepacking."),
    _var("KVSERVE_CPU_HUGE_PAGES", "choice", "auto",
         "Default of --cpu-huge-pages: advise transparent huge pages for CPU weights.",
         ("auto", "on", "off")),
    # Test sizes (read by tests/, declared here like every other KVSERVE_* variable).
    _var("KVSERVE_SOAK_REQUESTS", "int", 0,
         "Requests of tests/entrypoints/test_soak.py (0: the small CI pass; 10000: the full "
         "soak)."),
    _var("KVSERVE_TEST_FULL", "bool", False,
         "Also run the long variants of tests that CI runs in a shorter form (e.g. the packed "
         "GGUF perplexity of the mixed-type file)."),
    _var("KVSERVE_KILL_TESTS_EXPENSIVE", "bool", False,
         "Also run the expensive kill tests of tests/reliability/ (Ray worker actor, P/D "
         "prefill, decode and proxy with NIXL)."),
)}


def get(name: str) -> Any:
    """The variable's value now: parsed from the environment, or its default when unset or
    empty. Raises KeyError for a name not in ENV_VARS (declare it there first)."""
    var = ENV_VARS[name]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return var.default
    return var.parse(raw)


def is_set(name: str) -> bool:
    ENV_VARS[name]                 # KeyError for an undeclared name
    raw = os.environ.get(name)
    return raw is not None and bool(raw.strip())


def cache_dir() -> str:
    """kvserve's cache directory (the demo model, GGUF metadata, compiled kernels):
    $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."""
    cache = get("KVSERVE_CACHE_DIR")
    if cache:
        return os.path.expanduser(cache)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "kvserve")


def describe() -> str:
    """One line per variable, for `--help` epilogs and the README."""
    return "\n".join(f"  {v.name} (default {v.default!r}): {v.doc}" for v in ENV_VARS.values())


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
