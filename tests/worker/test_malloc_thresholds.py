"""utils/memory.py's two malloc phases, seen from where glibc puts a 1 MiB block: while a
process loads (configure_process_memory: 128 KiB thresholds) a block that size gets its own
mapping; once it serves (serving_thresholds: 32 MiB) it comes from the heap, so a step's
activations reuse memory instead of page-faulting fresh mappings. Each case runs in a fresh
interpreter: mallopt settings last for the process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

PROBE = textwrap.dedent("""
    import ctypes, sys
    from kvserve.utils import memory

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]

    def in_heap(size):
        p = libc.malloc(size)
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= p < hi:
                    return line.rstrip().endswith("[heap]")
        raise AssertionError("no mapping holds the block")

    import gc
    if sys.argv[1] != "unconfigured":     # "api": an API server's process, no engine of its own
        memory.configure_process_memory("probe", owns_engine=sys.argv[1] != "api")
    loading = in_heap(1 << 20)
    if sys.argv[1] != "load":
        memory.serving_thresholds("probe")
    print(loading, in_heap(1 << 20), gc.get_freeze_count() > 0)
""")


def _probe(phase: str, env: dict[str, str] | None = None) -> tuple[str, str, str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    full_env.update(env or {})
    out = subprocess.run([sys.executable, "-c", PROBE, phase], capture_output=True, text=True,
                         env=full_env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loading, after, frozen = out.stdout.split()
    return loading, after, frozen


def test_blocks_leave_the_heap_while_loading_and_use_it_once_serving() -> None:
    """And serving freezes the start-up heap for the GC in an engine's own process (not before,
    not in an API server's process, whose entry point tests call in pytest's, and not where
    kvserve did not configure memory: an in-process engine)."""
    assert _probe("load") == ("False", "False", "False")
    assert _probe("serve") == ("False", "True", "True")
    assert _probe("api") == ("False", "True", "False")
    assert _probe("unconfigured")[2] == "False"


def test_a_threshold_the_user_set_is_left_alone() -> None:
    # MALLOC_MMAP_THRESHOLD_ read by glibc at start: 128 KiB stays in force while serving.
    assert _probe("serve", {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}) == ("False", "False",
                                                                            "True")
