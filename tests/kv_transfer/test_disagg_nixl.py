"""Disaggregated prefill/decode: two `kvserve serve` instances with NixlConnector behind
`kvserve proxy`, driven with the official openai client.

The decode instance READs each prompt's KV blocks from the prefill instance (NIXL, UCX, CPU
memory) and computes only the prompt's last token itself; outputs equal one plain instance.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from typing import Iterator

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


def test_prefill_killed_after_prefill_falls_back(prefill: RemoteServer, decode: RemoteServer,
                                                 proxy: Proxy) -> None:
    """The prefill instance dies holding the blocks the decode instance is about to READ: the
    decode instance computes the prompt itself (same answer), frees everything, keeps
    serving; the proxy then answers 503 for the dead instance. Runs last: it kills it."""
    model = _client(decode.url_v1).models.list().data[0].id
    prompt = random_prompts(1, 40, 40, 1024, seed=21)[0]
    resp = httpx.post(prefill.url_for("/v1/completions"), timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    kv = resp["kv_transfer_params"]
    assert kv["do_remote_prefill"] and len(kv["remote_block_ids"]) == 3
    prefill.kill()
    deadline = time.monotonic() + 10   # the engine core child is reaped by init shortly
    while prefill.session_alive():
        assert time.monotonic() < deadline, "a process of the prefill instance is left"
        time.sleep(0.1)

    fallbacks0 = _metric(decode, "kv_transfer_local_fallbacks_total")
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    started = time.monotonic()
    out = httpx.post(decode.url_for("/v1/completions"), timeout=60,
                     json={**body, "kv_transfer_params": kv}).json()
    assert time.monotonic() - started < 30
    assert _metric(decode, "kv_transfer_local_fallbacks_total") == fallbacks0 + 1
    plain = httpx.post(decode.url_for("/v1/completions"), timeout=60, json=body).json()
    assert out["choices"][0]["text"] == plain["choices"][0]["text"]
    _wait_blocks_free(decode)

    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        _client(proxy.url_v1).completions.create(model=model, prompt="hello", max_tokens=4)
    assert err.value.status_code == 503 and time.monotonic() - started < 15
    assert httpx.get(decode.url_for("/health"), timeout=5).status_code == 200
