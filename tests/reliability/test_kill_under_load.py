"""Each process kind of a `kvserve serve` setup SIGKILLed under load (tests/reliability/
kill_utils.py says what load and what is checked): an engine core, a tensor-parallel worker, a
pipeline stage, a data-parallel engine, one API server of `--api-server-count 2`.

For each: the streaming clients get an error within 5 s, none hangs, a fresh request is
answered 503 or refused, `kvserve serve` exits with a non-zero status by itself (vLLM's
default; `--keep-alive-on-engine-death` keeps it up answering 503: tests/entrypoints/
test_openai_server.py), and no process or /dev/shm segment of the setup is left. A killed
data-parallel engine is the exception: the other engine goes on serving (test_kill_dp_engine).

The five servers start together (one module fixture: their start-up overlaps) and each test
kills its own. The expensive kinds (Ray worker actor, the P/D prefill, decode and proxy) are in
test_kill_expensive.py, behind KVSERVE_KILL_TESTS_EXPENSIVE=1.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional

import httpx
import psutil
import pytest

from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer
from tests.reliability.kill_utils import (CLIENT_DEADLINE_S, LEFTOVER_WAIT_S, alive,
                                          assert_clean_failure, find_process, kill_under_load,
                                          named, shm_of, tree_pids)

pytestmark = pytest.mark.timeout(300)

BASE_ARGS = [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
SETUPS = {
    "engine_core": [],
    "tp_worker": ["-tp", "2"],
    "pp_stage": ["-pp", "2"],
    "dp_engine": ["-dp", "2"],
    "api_server": ["--api-server-count", "2"],
}


def _is_engine_core(server_pid: int):
    # The engine core is the server's spawned child (the other child is multiprocessing's
    # resource tracker).
    def match(p: psutil.Process) -> bool:
        return p.ppid() == server_pid and "spawn_main" in " ".join(p.cmdline())
    return match


VICTIMS = {
    "engine_core": _is_engine_core,
    "tp_worker": lambda pid: named("KVSWorker_TP1"),
    "pp_stage": lambda pid: named("KVSWorker_TP1"),        # rank 1: the second stage
    "dp_engine": lambda pid: named("KVSEngine_DP1"),
    "api_server": lambda pid: named("KVSAPIServer1"),
}


@pytest.fixture(scope="module")
def servers(tiny_llama: str) -> Iterator[dict[str, RemoteServer]]:
    started: dict[str, RemoteServer] = {}

    def start(kind: str) -> None:
        started[kind] = RemoteServer(tiny_llama, [*BASE_ARGS, *SETUPS[kind]])

    with ThreadPoolExecutor(len(SETUPS)) as pool:
        futures = [pool.submit(start, kind) for kind in SETUPS]
    try:
        for f in futures:
            f.result()
        yield started
    finally:
        for srv in started.values():
            srv.close()


def _wait_exit(srv: RemoteServer):
    def wait(timeout: float) -> Optional[int]:
        try:
            return srv.proc.wait(timeout)
        except Exception:  # noqa: BLE001 - still running: None
            return None
    return wait


def _kill(servers: dict[str, RemoteServer], kind: str, **kw) -> "object":
    srv = servers[kind]
    victim = find_process(srv.proc.pid, VICTIMS[kind](srv.proc.pid))
    model = httpx.get(srv.url_for("/v1/models"), timeout=10).json()["data"][0]["id"]
    return kill_under_load(kind, srv.base_url, model, srv.proc.pid, victim.pid,
                           _wait_exit(srv), **kw)


@pytest.mark.parametrize("kind", ["engine_core", "tp_worker", "pp_stage", "api_server"])
def test_kill_under_load(servers: dict[str, RemoteServer], kind: str) -> None:
    # One API server gone: the launcher stops the engines, the other server fails its streams
    # and exits; a fresh request a moment later finds it going or gone.
    report = _kill(servers, kind, fresh_delay=2.0 if kind == "api_server" else 0.2)
    assert_clean_failure(report)
    if kind != "api_server":
        log = servers[kind].log_text()
        assert "shutting the server down" in log, log[-3000:]


def _stop_and_check_nothing_left(srv: RemoteServer, pids: set[int]) -> None:
    assert srv.terminate(timeout=30) is not None, srv.log_text()[-3000:]
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids) and not shm_of(pids), (alive(pids), shm_of(pids))


def test_kill_dp_engine(servers: dict[str, RemoteServer]) -> None:
    """A data-parallel engine dies: its own requests fail at once (503), /health turns 503
    (an orchestrator's liveness probe restarts the server), and the surviving engine finishes
    its requests and keeps serving (tests/distributed/test_data_parallel.py: by design, the
    one place where kvserve stays up without --keep-alive-on-engine-death)."""
    srv = servers["dp_engine"]
    pids = tree_pids(srv.proc.pid)
    report = _kill(servers, "dp_engine", keep_alive_wait=0.5, wait_all_s=CLIENT_DEADLINE_S + 3)
    assert "hung" not in report.outcomes, report.line()
    assert report.error_times() and max(report.error_times()) <= CLIENT_DEADLINE_S, report.line()
    # The survivor's clients: finished, or still getting tokens well after the kill.
    assert {"finished", "streaming"} & set(report.outcomes), report.line()
    assert report.exit_code is None and report.fresh_outcome == "HTTP 200", report.line()
    assert httpx.get(srv.url_for("/health"), timeout=5).status_code == 503
    _stop_and_check_nothing_left(srv, pids)
