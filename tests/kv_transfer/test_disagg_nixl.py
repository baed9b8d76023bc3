"""Disaggregated prefill/decode: two `kvserve serve` instances with NixlConnector behind
`kvserve proxy`, driven with the official openai client.

The decode instance READs each prompt's KV blocks from the prefill instance (NIXL, UCX, CPU
memory) and computes only the prompt's last token itself; outputs equal one plain instance.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional

import httpx
import openai
import pytest

from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer, _free_port
from tests.utils import random_prompts

pytest.importorskip("nixl_cu12", reason="NixlConnector needs the pd extra (nixl-cu12)")

BLOCK_SIZE = 16


def _nixl_args(**extra: float) -> list[str]:
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}
    return [*SERVER_ENGINE_ARGS, "--block-size", str(BLOCK_SIZE), "--uvicorn-log-level",
            "warning", "--disable-uvicorn-access-log", "--kv-transfer-config", json.dumps(config)]


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve.entrypoints.cli", "proxy", "--port", str(self.port),
             "--prefill", *prefill, "--decode", *decode, "--timeout", "60"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()  # type: ignore[union-attr]
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("proxy did not start")

    @property
    def url_v1(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def prefill(tiny_llama: str) -> Iterator[RemoteServer]:
    # Build the CPU kernels (if this session has not yet) once, here, not in both servers.
    from kvserve.ops import load_cpu_kernels
    load_cpu_kernels()
    srv = RemoteServer(tiny_llama, _nixl_args(abort_request_timeout_s=60))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def decode(tiny_llama: str) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llama, _nixl_args(transfer_timeout_s=5, handshake_timeout_s=2))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def proxy(prefill: RemoteServer, decode: RemoteServer) -> Iterator[Proxy]:
    p = Proxy([prefill.base_url], [decode.base_url])
    yield p
    p.close()


def _client(url_v1: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url_v1, api_key="EMPTY", max_retries=0, timeout=60)


def _metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url_for("/metrics"), timeout=10).text
    m = re.search(rf"^kvserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def _wait_blocks_free(server: RemoteServer, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(server, "kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, f"{server.base_url} still holds KV blocks"
        time.sleep(0.2)


def _completions(client: openai.OpenAI, model: str, prompts: list, stream: bool) -> list[tuple]:
    results = []
    for prompt in prompts:
        kw = dict(model=model, prompt=prompt, max_tokens=12, temperature=0.0)
        if stream:
            text, finish = "", None
            for chunk in client.completions.create(stream=True, **kw):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            results.append((text, finish))
        else:
            choice = client.completions.create(**kw).choices[0]
            results.append((choice.text, choice.finish_reason))
    return results


def _chats(client: openai.OpenAI, model: str, questions: list[str], stream: bool) -> list[tuple]:
    results = []
    for q in questions:
        kw = dict(model=model, messages=[{"role": "user", "content": q}], max_tokens=10,
                  temperature=0.0)
        if stream:
            text, finish = "", None
            for chunk in client.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            results.append((text, finish))
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            results.append((choice.message.content, choice.finish_reason))
    return results


def test_proxy_equals_single_instance(prefill: RemoteServer, decode: RemoteServer,
                                      proxy: Proxy) -> None:
    pd_client, single = _client(proxy.url_v1), _client(decode.url_v1)
    model = pd_client.models.list().data[0].id
    # Lengths: partial last block, exact blocks, one block, shorter than a block.
    prompts = [random_prompts(1, n, n, 1024, seed=11 + i)[0]
               for i, n in enumerate((45, 32, 16, 5))]
    questions = ["Tell me a story.", "What is two plus two?"]
    hits0, xfers0 = _metric(decode, "external_prefix_cache_hits_total"), _metric(
        decode, "kv_transfers_total")

    # P/D runs first: the decode instance's own prefix cache is still cold for these prompts.
    pd = [_completions(pd_client, model, prompts, stream=False),
          _completions(pd_client, model, prompts[:2], stream=True),
          _chats(pd_client, model, questions, stream=False),
          _chats(pd_client, model, questions[:1], stream=True)]
    hits = _metric(decode, "external_prefix_cache_hits_total") - hits0
    xfers = _metric(decode, "kv_transfers_total") - xfers0
    # The decode instance loaded every prompt token of the completions (it recomputes only the
    # last one); stream reruns of the same prompts hit its local prefix cache instead.
    assert hits >= sum(len(p) for p in prompts)
    assert xfers >= len(prompts) + 2
    assert _metric(decode, "kv_transfer_bytes_total") > 0
    assert _metric(decode, "kv_transfer_local_fallbacks_total") == 0
    assert _metric(prefill, "num_requests_running") == 0

    single_runs = [_completions(single, model, prompts, stream=False),
                   _completions(single, model, prompts[:2], stream=True),
                   _chats(single, model, questions, stream=False),
                   _chats(single, model, questions[:1], stream=True)]
    assert pd == single_runs
    assert any(t for run in pd for t, _ in run)
    # Both sides give their blocks back: the prefill side once the decode side has read them.
    _wait_blocks_free(prefill)
    _wait_blocks_free(decode)


def test_bad_kv_transfer_params_is_400(decode: RemoteServer) -> None:
    client = _client(decode.url_v1)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="remote_block_ids"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x",
                                   "remote_block_ids": "nope", "remote_host": "127.0.0.1",
                                   "remote_port": 1}})
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].text


def _prefill_leg(server: RemoteServer, model: str, prompt: str) -> dict:
    """What the proxy does first: the prompt's KV on the prefill instance, kept for a READ."""
    resp = httpx.post(server.url_for("/v1/completions"), timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    kv = resp["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["remote_block_ids"]
    return kv


def _wait_read_in_flight(decode: RemoteServer, pending: Future, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _metric(decode, "kv_transfers_in_flight") < 1:
        assert not pending.done(), f"the request ended before its READ was seen: {pending}"
        assert time.monotonic() < deadline, "the decode instance never had a READ in flight"
        time.sleep(0.05)


def test_prefill_hung_or_killed_during_read(prefill: RemoteServer, decode: RemoteServer,
                                            proxy: Proxy) -> None:
    """The prefill instance stops (SIGSTOP) or dies (SIGKILL) while the decode instance's READ
    of its blocks is in flight (seen on the decode side's kv_transfers_in_flight gauge). NIXL
    leaves a READ from a stopped peer "in progress" for ever: it is released after
    transfer_timeout_s (5 s here). A peer killed mid-READ makes NIXL raise a disconnect error
    (seen in the decode instance's log: no need to wait for the timeout).
    Either way the client gets the right answer (computed locally, counted), the decode
    instance frees every block, keeps serving, and nothing of the prefill instance is left.
    Runs last: it kills the prefill instance."""
    model = _client(decode.url_v1).models.list().data[0].id
    prompts = [random_prompts(1, 40, 40, 1024, seed=21 + i)[0] for i in range(3)]
    # A first P/D request: the decode instance has met this prefill instance (handshake done),
    # so the READs below are posted at once rather than stuck in the handshake.
    assert _completions(_client(proxy.url_v1), model, prompts[2:], stream=False)[0][0]
    kvs = [_prefill_leg(prefill, model, p) for p in prompts[:2]]
    fallbacks0 = _metric(decode, "kv_transfer_local_fallbacks_total")
    started0 = _metric(decode, "kv_transfers_started_total")

    def decode_leg(prompt: str, kv: Optional[dict]) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        if kv is not None:
            body["kv_transfer_params"] = kv
        resp = httpx.post(decode.url_for("/v1/completions"), timeout=60, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]

    pgid = prefill.proc.pid   # type: ignore[union-attr]
    with ThreadPoolExecutor(1) as pool:
        # Hung: the READ never completes; the timeout releases it.
        os.killpg(pgid, signal.SIGSTOP)
        started = time.monotonic()
        hung = pool.submit(decode_leg, prompts[0], kvs[0])
        _wait_read_in_flight(decode, hung)
        text_hung = hung.result(timeout=60)
        assert time.monotonic() - started >= 5.0   # it waited for the READ's timeout
        assert _metric(decode, "kv_transfer_local_fallbacks_total") == fallbacks0 + 1
        assert _metric(decode, "kv_transfers_in_flight") == 0
        # Killed mid-READ: NIXL reports the disconnect; no need to wait for the timeout.
        killed = pool.submit(decode_leg, prompts[1], kvs[1])
        _wait_read_in_flight(decode, killed)
        prefill.kill()
        text_killed = killed.result(timeout=60)
    log = decode.log_text()
    assert log.count("timed out after 5 s; computing it locally") == 1
    assert log.count("failed: ERR (nixlRemoteDisconnectError") == 1
    assert _metric(decode, "kv_transfer_local_fallbacks_total") == fallbacks0 + 2
    assert _metric(decode, "kv_transfers_started_total") == started0 + 2
    assert _metric(decode, "kv_transfers_in_flight") == 0
    deadline = time.monotonic() + 10   # the engine core child is reaped by init shortly
    while prefill.session_alive():
        assert time.monotonic() < deadline, "a process of the prefill instance is left"
        time.sleep(0.1)
    # The right answers: what the decode instance computes with no transfer at all.
    assert [text_hung, text_killed] == [decode_leg(p, None) for p in prompts[:2]]
    _wait_blocks_free(decode)
    for name in ("num_requests_running", "num_requests_waiting"):
        assert _metric(decode, name) == 0

    # The prefill instance is gone: the proxy answers 503 at once, the decode one still serves.
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        _client(proxy.url_v1).completions.create(model=model, prompt="hello", max_tokens=4)
    assert err.value.status_code == 503 and time.monotonic() - started < 15
    assert httpx.get(decode.url_for("/health"), timeout=5).status_code == 200
    assert decode_leg("hello", None)
