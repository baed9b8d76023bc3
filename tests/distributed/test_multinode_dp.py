"""Multi-node data parallelism on loopback, and several API servers on one port.

Two "nodes": a front `kvserve serve -dp 2 --data-parallel-size-local 1 --data-parallel-address
127.0.0.1 --data-parallel-rpc-port P` (API server, coordinator, engine 0) and a second process
`kvserve serve ... --data-parallel-start-rank 1 --headless` (engine 1 only), joined by the
ZMQ/TCP handshake. Plus the bad inputs that must fail fast instead of hanging, and
`--api-server-count 2`.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from kvserve.engine.arg_utils import EngineArgs
from kvserve.entrypoints.cli import main as cli_main
from tests.distributed.test_data_parallel import (_complete_all, _generation_tokens,
                                                   _prompts_and_reference)
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer, _free_port

NUM_REQUESTS = 24
MAX_TOKENS = 8
MAX_NUM_SEQS = 2


def _serve_cmd(model: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model, *args]


def _dp_args(rpc_port: int, *extra: str) -> list[str]:
    return [*SERVER_ENGINE_ARGS, "--max-num-seqs", str(MAX_NUM_SEQS), "-dp", "2",
            "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
            "--data-parallel-rpc-port", str(rpc_port), *extra]


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------- bad input, fast
@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel_size=2, data_parallel_size_local=3), "between 0 and data_parallel_size"),
    (dict(data_parallel_size=2, data_parallel_size_local=1, data_parallel_start_rank=2,
          data_parallel_address="127.0.0.1"), "exceeds data_parallel_size"),
    (dict(data_parallel_size=2, data_parallel_size_local=1), "need data_parallel_address"),
])
def test_impossible_dp_layout_is_a_value_error(tiny_llama: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(tiny_llama, **kwargs).create_engine_config()


def test_headless_without_address_fails_at_once(tiny_llama: str,
                                                capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["serve", tiny_llama, "-dp", "2", "--data-parallel-size-local", "1",
                     "--data-parallel-start-rank", "1", "--headless"]) == 2
    assert "--headless needs --data-parallel-address" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_headless_engine_gives_up_on_unreachable_front(tiny_llama: str) -> None:
    port = _free_port()      # nothing listens there
    start = time.monotonic()
    out = subprocess.run(
        _serve_cmd(tiny_llama, *_dp_args(port, "--data-parallel-start-rank", "1", "--headless")),
        capture_output=True, text=True, timeout=100,
        env={**os.environ, "KVSERVE_DP_HANDSHAKE_TIMEOUT": "3"})
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"Did not receive the init message from the front end at tcp://127.0.0.1:{port}" \
        in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - start < 90


@pytest.mark.timeout(120)
def test_front_gives_up_on_missing_engines(tiny_llama: str) -> None:
    port = _free_port()
    out = subprocess.run(
        _serve_cmd(tiny_llama, "--port", str(_free_port()), *_dp_args(port)),
        capture_output=True, text=True, timeout=100,
        env={**os.environ, "KVSERVE_DP_HANDSHAKE_TIMEOUT": "3"})
    assert out.returncode != 0
    assert "engine(s) with DP rank [1] did not connect" in out.stderr, out.stderr[-2000:]


# ---------------------------------------------------------------------- two nodes
async def _wait_for_load(server: RemoteServer, running: int, timeout: float) -> dict:
    """Poll /load until it reports `running` requests (both engines' sum)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while True:
            load = (await http.get(server.url_for("/load"))).json()
            if load["num_requests_running"] == running or time.monotonic() > deadline:
                return load
            await asyncio.sleep(0.1)


@pytest.mark.timeout(300)
def test_two_node_dp_on_loopback(tiny_llama: str) -> None:
    prompts, reference = _prompts_and_reference(tiny_llama, NUM_REQUESTS, MAX_TOKENS)
    rpc_port = _free_port()
    headless = subprocess.Popen(
        _serve_cmd(tiny_llama, *_dp_args(rpc_port, "--data-parallel-start-rank", "1",
                                         "--headless")),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = None
    try:
        # --keep-alive-on-engine-death: the front keeps serving on engine 0 when the headless
        # node's engine dies (by default the whole server would exit, as vLLM's does).
        server = RemoteServer(tiny_llama, [*_dp_args(rpc_port), "--keep-alive-on-engine-death"])
        front = {p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)}
        assert {"KVSEngine_DP0", "KVSDPCoord"} <= front and "KVSEngine_DP1" not in front
        remote = [p for p in psutil.Process(headless.pid).children(recursive=True)
                  if p.name().startswith("KVS")]
        assert [p.name() for p in remote] == ["KVSEngine_DP1"]

        results = asyncio.run(_complete_all(server, tiny_llama, prompts, MAX_TOKENS))
        assert not [r for r in results if isinstance(r, BaseException)], results[:3]
        assert [r.choices[0].text for r in results] == reference
        tokens = _generation_tokens(server)
        assert sum(tokens.values()) == NUM_REQUESTS * MAX_TOKENS
        assert tokens.get("0", 0) > 0 and tokens.get("1", 0) > 0, tokens

        # /load sums both engines; then the headless node's engine dies mid-generation.
        long_prompts = [f"long request {i}" for i in range(4 * MAX_NUM_SEQS)]

        async def run() -> tuple[dict, list]:
            task = asyncio.ensure_future(_complete_all(server, tiny_llama, long_prompts, 200))
            load = await _wait_for_load(server, 2 * MAX_NUM_SEQS, timeout=30)
            os.kill(remote[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            async with httpx.AsyncClient() as http:
                while (await http.get(server.url_for("/health"))).status_code != 503:
                    assert time.monotonic() - killed < 10.0, "/health still 200 after 10 s"
                    await asyncio.sleep(0.1)
            return load, await task

        load, results = asyncio.run(run())
        assert load["num_requests_running"] == 2 * MAX_NUM_SEQS, load
        assert load["num_requests_waiting"] + load["num_requests_running"] <= len(long_prompts)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and len(failed) < len(results), results
        assert all(isinstance(e, openai.APIStatusError) and e.status_code == 503
                   for e in failed), failed
        # The headless node stops with its engine; the front keeps serving on engine 0.
        assert headless.wait(15) != 0
        again = asyncio.run(_complete_all(server, tiny_llama, ["after the crash"], 4))
        assert not isinstance(again[0], BaseException), again
        assert server.terminate(timeout=30) is not None, server.log_text()[-3000:]
        deadline = time.monotonic() + 10
        while (server.session_alive() or _session_alive(headless.pid)) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.session_alive() and not _session_alive(headless.pid)
    finally:
        if server is not None:
            server.close()
        _kill_session(headless)


# ---------------------------------------------------------------------- API servers
@pytest.mark.timeout(240)
def test_two_api_servers_share_the_port(tiny_llama: str) -> None:
    server = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "--api-server-count", "2"])
    try:
        # /health answered means one server is up; the other may still be importing (a
        # spawned process is named "python" until its entry point names it).
        deadline = time.monotonic() + 60
        while True:
            names = {p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)}
            if {"KVSAPIServer0", "KVSAPIServer1"} <= names or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {"KVSAPIServer0", "KVSAPIServer1"} <= names, names
        prompts = [f"request {i}" for i in range(32)]
        # The kernel spreads connections only over the sockets already listening: a server that
        # came up a moment after the first answered /health may miss a whole first round.
        for rounds in range(1, 4):
            results = asyncio.run(_complete_all(server, tiny_llama, prompts, MAX_TOKENS))
            assert not [r for r in results if isinstance(r, BaseException)], results[:3]
            # Which server answered: each one's access log lines carry its process name.
            log = server.log_text()
            served = {i: len(re.findall(rf'\[APIServer_{i}\].*"POST /v1/completions', log))
                      for i in (0, 1)}
            if served[0] > 0 and served[1] > 0:
                break
        assert served[0] > 0 and served[1] > 0 and sum(served.values()) == 32 * rounds, served
        # /metrics (from either server) adds up both servers' requests.
        for _ in range(4):
            text = httpx.get(server.url_for("/metrics"), timeout=10).text
            assert sum(_generation_tokens_in(text)) == 32 * rounds * MAX_TOKENS
            success = re.findall(r'^kvserve:request_success_total\{[^}]*finished_reason='
                                 r'"length"[^}]*\} ([0-9.e+]+)$', text, flags=re.M)
            assert sum(float(v) for v in success) == 32 * rounds, success
        assert server.terminate(timeout=30) == 0, server.log_text()[-3000:]
        deadline = time.monotonic() + 10
        while server.session_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not server.session_alive()
    finally:
        server.close()


def _generation_tokens_in(text: str) -> list[float]:
    return [float(v) for v in re.findall(
        r'^kvserve:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$', text, flags=re.M)]
