"""An idle NIXL agent (NixlConnector's, make_nixl_agent) uses no CPU: NIXL's UCX progress
thread used to spin (poll() with a timeout of 0: 67% of a core on an idle P/D instance; an
idle prefill + decode pair measured 17.6% + 12.7% of a core on a loaded 2-core machine before,
0.9% + 1.0% after). Transfers themselves: test_disagg_nixl.py.
"""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("nixl_cu12", reason="NixlConnector needs the pd extra (nixl-cu12)")

from kvserve.kv_transfer.nixl import make_nixl_agent  # noqa: E402

WINDOW_S = 2.0
# A spinning progress thread takes a whole core on a quiet machine, and still over 8% of one
# on a 2-core machine at load average 20; the sleeping one about 0.4%.
MAX_IDLE_CORE_FRACTION = 0.03


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each thread of this process (its native threads included)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def test_idle_nixl_agent_uses_no_cpu() -> None:
    before_threads = set(_thread_cpu_s())
    agent = make_nixl_agent(f"idle-test-{os.getpid()}")
    try:
        time.sleep(0.2)
        new = set(_thread_cpu_s()) - before_threads
        assert new, "NIXL started no thread: is its progress thread gone?"
        a = _thread_cpu_s()
        time.sleep(WINDOW_S)
        b = _thread_cpu_s()
        used = sum(b[t] - a.get(t, b[t]) for t in new if t in b)
        assert used / WINDOW_S < MAX_IDLE_CORE_FRACTION, \
            f"NIXL's threads used {100 * used / WINDOW_S:.1f}% of a core while idle"
    finally:
        del agent
