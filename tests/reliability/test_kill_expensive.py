"""The expensive kill tests (tests/reliability/kill_utils.py says what load and what is
checked), opt-in: KVSERVE_KILL_TESTS_EXPENSIVE=1 python -m pytest tests/reliability -s

- a Ray worker actor of `kvserve serve -tp 2 --distributed-executor-backend ray` (a local Ray
  cluster started by the engine core);
- disaggregated prefill/decode (NixlConnector, tests/kv_transfer/test_disagg_nixl.py's setup)
  behind `kvserve proxy`: the proxy (restarted afterwards), the decode instance's API server
  process (a new decode instance afterwards), then the prefill instance's API server process
  while a READ of its KV blocks is in flight. Killing an instance's main process leaves its engine core to notice by itself.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional

import httpx
import pytest

from kvserve import envs
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer
from tests.reliability.kill_utils import (CLIENT_DEADLINE_S, assert_clean_failure,
                                          find_process, kill_under_load)

pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(
    not envs.get("KVSERVE_KILL_TESTS_EXPENSIVE"),
    reason="expensive kill tests: KVSERVE_KILL_TESTS_EXPENSIVE=1")]


def _wait_exit(proc):
    def wait(timeout: float) -> Optional[int]:
        try:
            return proc.wait(timeout)
        except Exception:  # noqa: BLE001 - still running
            return None
    return wait


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_kill_ray_worker_actor(tiny_llama: str) -> None:
    pytest.importorskip("ray")
    srv = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning",
                                    "--disable-uvicorn-access-log", "-tp", "2",
                                    "--distributed-executor-backend", "ray"])
    try:
        actor = find_process(srv.proc.pid, lambda p: "RayWorkerWrapper" in " ".join(p.cmdline())
                             or "RayWorkerWrapper" in p.name())
        report = kill_under_load("ray_worker_actor", srv.base_url, _model(srv.base_url),
                                 srv.proc.pid, actor.pid, _wait_exit(srv.proc))
        assert_clean_failure(report)
    finally:
        srv.close()


# ---------------------------------------------------------------------- P/D
@pytest.fixture(scope="module")
def pd(tiny_llama: str) -> Iterator[dict]:
    pytest.importorskip("nixl_cu12")
    from tests.kv_transfer.test_disagg_nixl import Proxy, _nixl_args
    prefill = RemoteServer(tiny_llama, _nixl_args(abort_request_timeout_s=60))
    decode = RemoteServer(tiny_llama, _nixl_args(transfer_timeout_s=5, handshake_timeout_s=2))
    setup = {"prefill": prefill, "decode": decode,
             "proxy": Proxy([prefill.base_url], [decode.base_url]), "Proxy": Proxy}
    try:
        yield setup
    finally:
        setup["proxy"].close()
        for srv in (setup["decode"], prefill):
            if srv.proc.poll() is None or os.path.exists(srv._log.name):
                srv.close()


def _proxy_url(proxy) -> str:
    return proxy.url_v1.removesuffix("/v1")


def test_kill_pd_proxy(pd: dict) -> None:
    proxy = pd["proxy"]
    report = kill_under_load("pd_proxy", _proxy_url(proxy), _model(pd["decode"].base_url),
                             proxy.proc.pid, proxy.proc.pid, _wait_exit(proxy.proc))
    assert_clean_failure(report)
    # The instances aborted the proxy's requests: every block free, nothing running.
    from tests.kv_transfer.test_disagg_nixl import _metric, _wait_blocks_free
    for srv in (pd["prefill"], pd["decode"]):
        _wait_blocks_free(srv)
        assert _metric(srv, "num_requests_running") == 0
    pd["proxy"] = pd["Proxy"]([pd["prefill"].base_url], [pd["decode"].base_url])


def test_kill_pd_decode(pd: dict, tiny_llama: str) -> None:
    """The decode instance's API server process killed while clients stream through the
    proxy; then a new decode instance (and proxy) for the next test."""
    from tests.kv_transfer.test_disagg_nixl import _nixl_args
    decode = pd["decode"]
    report = kill_under_load("pd_decode", _proxy_url(pd["proxy"]), _model(decode.base_url),
                             decode.proc.pid, decode.proc.pid, _wait_exit(decode.proc))
    assert_clean_failure(report)
    pd["proxy"].close()
    decode.close()          # its log; the processes are gone (checked above)
    pd["decode"] = RemoteServer(tiny_llama, _nixl_args(transfer_timeout_s=5,
                                                       handshake_timeout_s=2))
    pd["proxy"] = pd["Proxy"]([pd["prefill"].base_url], [pd["decode"].base_url])


def test_kill_pd_prefill_mid_transfer(pd: dict) -> None:
    """Clients whose KV was being read get their answer anyway (the decode instance computes
    it locally: tests/kv_transfer/test_disagg_nixl.py), the others an error; none hangs."""
    from tests.kv_transfer.test_disagg_nixl import _metric
    prefill, decode, proxy = pd["prefill"], pd["decode"], pd["proxy"]
    report = kill_under_load(
        "pd_prefill_mid_transfer", _proxy_url(proxy), _model(decode.base_url), prefill.proc.pid,
        prefill.proc.pid, _wait_exit(prefill.proc), wait_all_s=CLIENT_DEADLINE_S + 20,
        trigger=lambda: _metric(decode, "kv_transfers_in_flight") >= 1)
    assert "hung" not in report.outcomes, report.line()
    assert max(report.error_times(), default=0.0) <= CLIENT_DEADLINE_S, report.line()
    assert report.fresh_outcome == "HTTP 503", report.line()
    assert report.exit_code not in (None, 0)
    assert not report.leftover_pids and not report.leftover_shm, report.line()
    assert httpx.get(decode.url_for("/health"), timeout=5).status_code == 200
