"""Triton kernels of the CUDA path (fused elementwise ops); attention kernels live in
kvserve/attention/ops/."""
from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
