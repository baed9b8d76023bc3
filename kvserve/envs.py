"""Parsing of kvserve's on/off environment switches (KVSERVE_CPU_FUSED_DECODE, ...)."""
from __future__ import annotations

import os


def env_switch(name: str, default: bool = True) -> bool:
    """The switch `name`: "1" or "0" (surrounding spaces ignored), `default` when unset;
    anything else is a ValueError, so a typo fails where it is read instead of passing."""
    mode = os.environ.get(name, "1" if default else "0").strip()
    if mode not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {mode!r}")
    return mode == "1"
