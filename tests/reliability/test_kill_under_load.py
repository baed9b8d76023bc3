"""Each process kind of a `kvserve serve` setup SIGKILLed under load (tests/reliability/
kill_utils.py says what load and what is checked): an engine core, a tensor-parallel worker, a
pipeline stage, a data-parallel engine, one API server of `--api-server-count 2`.

For each: every streaming client gets an error within 5 s, none hangs, a fresh request is
answered 503 or refused, `kvserve serve` exits with a non-zero status by itself (vLLM's
default; `--keep-alive-on-engine-death` keeps it up answering 503: tests/entrypoints/
test_openai_server.py, and with data parallelism the surviving engine serving on:
tests/distributed/test_data_parallel.py), and no process or /dev/shm segment of the setup is
left. A data-parallel engine's death is the whole server's, as the engine core's: the
survivor's clients get the error too.

The five servers start together (one module fixture: their start-up overlaps) and each test
kills its own. The expensive kinds (Ray worker actor, the P/D prefill, decode and proxy) are in
test_kill_expensive.py, behind KVSERVE_KILL_TESTS_EXPENSIVE=1.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import httpx
import psutil
import pytest

from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer
from tests.reliability.kill_utils import (assert_clean_failure, find_process, kill_under_load,
                                          named)

pytestmark = pytest.mark.timeout(300)

# Margin beside kill_utils' kill from a thread (the fix): a long load, so that a late kill still
# finds the streams running. On CI the kill came after the engine had finished all six streams,
# first of 220 tokens (stop 41), then of 480 (stop 42: the clients, parsing slower than the tiny
# model makes chunks, had read 7-57 chunks each and then read the rest after the kill). The
# tiny model gets 8192 positions here (its other tests keep 512): 8000 tokens a stream.
MAX_MODEL_LEN = 8192
BASE_ARGS = [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
             "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(64 << 20)]
MAX_TOKENS = 8000
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
def servers(make_checkpoint: Callable[..., str]) -> Iterator[dict[str, RemoteServer]]:
    path = make_checkpoint("llama", max_position_embeddings=MAX_MODEL_LEN)
    started: dict[str, RemoteServer] = {}

    def start(kind: str) -> None:
        started[kind] = RemoteServer(path, [*BASE_ARGS, *SETUPS[kind]])

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
    # One request first, as any client before: the server's first-request work (tokenizer,
    # detokenizer, first steps) then does not slow the streams the kill must interrupt.
    warm = httpx.post(srv.url_for("/v1/completions"), timeout=120,
                      json={"model": model, "prompt": "hi", "max_tokens": 4, "stream": True})
    assert warm.status_code == 200, warm.text
    return kill_under_load(kind, srv.base_url, model, srv.proc.pid, victim.pid,
                           _wait_exit(srv), max_tokens=MAX_TOKENS, **kw)


@pytest.mark.parametrize("kind", ["engine_core", "tp_worker", "pp_stage", "dp_engine",
                                  "api_server"])
def test_kill_under_load(servers: dict[str, RemoteServer], kind: str) -> None:
    # One API server gone: the launcher stops the engines, the other server fails its streams
    # and exits; a fresh request a moment later finds it going or gone.
    report = _kill(servers, kind, fresh_delay=2.0 if kind == "api_server" else 0.2)
    assert_clean_failure(report)
    # Every client, not only the victim's (a data-parallel survivor's clients too).
    assert all(o.startswith("error") for o in report.outcomes), report.line()
    if kind != "api_server":
        log = servers[kind].log_text()
        assert "shutting the server down" in log, log[-3000:]
