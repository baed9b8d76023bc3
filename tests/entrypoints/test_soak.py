"""A soak through a real `kvserve serve`, run with the default environment (no MALLOC_* or
ONEDNN_* variables: each kvserve process bounds its native caches itself at start,
kvserve/utils/memory.py), with faults between the requests.

One server, n-gram speculation on (requests whose prompt repeats itself get drafts, the others
decode plainly, so both paths run). The mix: completions and chat, streamed and not, n=2, stop
strings, JSON-schema structured outputs, logprobs (completion `logprobs`, chat `top_logprobs`),
prompts that repeat themselves (n-gram drafts accepted); a fifth of the streamed clients
abandon their stream after a random number of chunks; explicit aborts (a client cancels a
non-streamed request it sent a moment before); invalid requests (each answered 4xx) between
them. The same mix is replayed PASSES times: the first pass is the warm-up (shapes repeat, the
caches settle), a leak grows the same amount every pass.

Afterwards:
- 0 lost, 0 hung: every client call returned or failed as planned within CALL_TIMEOUT_S;
- every KV block free (`kvserve:kv_cache_usage_perc` 0), nothing running or waiting, /load 0;
- every request ended exactly once: the sum of `request_success_total` over its finish
  reasons (stop, length, abort) equals the engine requests sent (an n=2 request is two);
  invalid ones are not counted, they never reached the engine;
- RSS (VmRSS from /proc/<pid>/status) of the API server and of the engine core after the
  warm-up pass grew by at most RSS_TOLERANCE_MB by the end.

Size: CI runs a small pass (CI_REQUESTS requests; 39 s of calls + the server's start, 2 busy
cores). KVSERVE_SOAK_REQUESTS=10000 runs the full soak:
    KVSERVE_SOAK_REQUESTS=10000 python -m pytest tests/entrypoints/test_soak.py -s
Measured 2026-11-26, the full soak with the final mix (branch rel at ff0362e, tiny random
Llama, shared 2-core Zen 3 at load average 12-20): 10,000 calls (9,756 engine requests) in
2,730 s of calls (2,790 s with the server's start): 7,968 ok, 832 abandoned streams, 368
aborted, 832 invalid (each 4xx); 0 lost, 0 hung, 0 failed; finish reasons stop 1,099 +
length 7,440 + abort 1,217 = 9,756; no KV block in use, nothing running or waiting after;
n-gram drafts 22 (13 accepted); 13 complete JSON answers parsed. RSS MB start / after the
2,500-call warm-up / end (peak): API server 273.8 / 292.8 / 293.0 (293.0), engine core
294.9 / 638.4 / 649.0 (649.4): +0.2 and +10.7 MB over the last 7,500 calls (tolerance 24).
The engine core's warm-up growth (+344 MB) was ideep's per-shape computation cache
(LRU_CACHE_CAPACITY, 1,024 entries by default), bounded to 64 since (kvserve/utils/
memory.py; in-process probe of this mix: +40 MB a 100 requests before, +0.7 MB over 300
after); the full soak has not been rerun with that bound.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve import envs
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer

CI_REQUESTS = 120
REQUESTS = envs.get("KVSERVE_SOAK_REQUESTS") or CI_REQUESTS
PASSES = 4                      # the first is the warm-up
CONCURRENCY = 24
CALL_TIMEOUT_S = 60.0           # a client call not done by then is "hung"
# Growth allowed after the warm-up pass. The engine core's native caches fill over the first
# ~2,000 requests of this mix (+0.2 to 0.4 MB a request; then flat: 641.7 -> 641.7 MB over the
# next 2,500 in the full soak), so the CI pass (30 requests a pass) bounds the growth of its
# last 90 requests at 80 MB (a leak of 1 MB a request fails it), the full soak (2,500 a pass)
# at 24 MB (a leak of 4 KB a request, 30 MB over 7,500, fails it).
# Sizes between (KVSERVE_SOAK_REQUESTS=2000: warm-up pass of 500, the cache still filling
# until ~2,000, +121 MB after it) get 160 MB.
RSS_TOLERANCE_MB = 24.0 if REQUESTS >= 10000 else 80.0 if REQUESTS <= CI_REQUESTS else 160.0
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 3})
# Set by hand before issue 32; the server must not need them, so none leaks in from the
# environment that runs the test.
NATIVE_CACHE_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
                    "MALLOC_TOP_PAD_", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY",
                    "LD_PRELOAD")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WORDS = ["alpha", "beta", "gamma", "delta", "soak", "tea", "rain"]

pytestmark = pytest.mark.timeout(300 if REQUESTS <= CI_REQUESTS else 6 * 3600)


# ---------------------------------------------------------------------- the request mix
@dataclass
class Call:
    kind: str                   # what the client does: ok | abandon | abort | invalid
    path: str
    body: dict
    engine_requests: int = 0    # sequences the engine gets (n each); 0 for invalid ones
    abandon_after: int = 0      # chunks read before an abandoning client goes away
    abort_after_s: float = 0.0


def _prompt(rng: random.Random, repeat: bool = False) -> str:
    if repeat or rng.random() < 0.3:      # repeats itself: n-gram drafts
        return " ".join(rng.sample(WORDS, 3)) * rng.randint(2, 6)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


def _invalid(rng: random.Random, model: str) -> Call:
    prompt = {"model": model, "prompt": "x", "max_tokens": 4}
    bodies = [{**prompt, "temperature": -1}, {**prompt, "n": 0}, {**prompt, "logprobs": 1000},
              {**prompt, "stop": [""]}, {**prompt, "model": "no-such-model"},
              {**prompt, "prompt": [5] * 300},
              {"model": model, "messages": [], "max_tokens": 2},
              {"model": model, "messages": [{"role": "user", "content": "hi"}],
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": {"type": "nope"}}}}]
    body = rng.choice(bodies)
    return Call("invalid", "/v1/chat/completions" if "messages" in body else "/v1/completions",
                body)


def make_call(rng: random.Random, model: str, i: int) -> Call:
    """Call i of a pass. The faults come at fixed places, so that even the CI pass has each:
    an abandoned stream every 10th call (a fifth of the streams), an invalid request every
    12th, an explicit abort every 25th."""
    if i % 12 == 5:
        return _invalid(rng, model)
    abandon, abort = i % 10 == 7, i % 25 == 11 and i % 10 != 7
    stream = abandon or (not abort and rng.random() < 0.45)
    body = {"model": model, "max_tokens": rng.randint(1, 16), "stream": stream,
            "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 1 << 30)}
    if body["temperature"] > 0 and rng.random() < 0.15:
        body["n"] = 2
    if rng.random() < 0.15:
        body["stop"] = ["e", " t"]
    chat = i % 6 != 1 and rng.random() < 0.5
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        if rng.random() < 0.12:     # no stop strings: they would cut the JSON short
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": SCHEMA}}
            body["max_tokens"] = 40
            body.pop("stop", None)
        if rng.random() < 0.15:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = _prompt(rng, repeat=i % 6 == 1)
        if rng.random() < 0.15:
            body["logprobs"] = 2
    call = Call("ok", "/v1/chat/completions" if chat else "/v1/completions", body,
                engine_requests=body.get("n", 1))
    if abandon:
        body.update(max_tokens=rng.randint(8, 48), ignore_eos=True)
        call.kind, call.abandon_after = "abandon", rng.randint(1, 4)
    elif abort:
        body.update(max_tokens=60, ignore_eos=True, stream=True)    # + prompt < 256
        body.pop("stop", None)
        call.kind, call.abort_after_s = "abort", rng.uniform(0.0, 0.5)
    return call


# ---------------------------------------------------------------------- the clients
@dataclass
class Tally:
    calls: int = 0
    engine_requests: int = 0
    outcomes: dict = field(default_factory=lambda: {"ok": 0, "abandon": 0, "abort": 0,
                                                    "invalid": 0})
    json_answers: int = 0
    failures: list = field(default_factory=list)     # lost, hung, or wrong


async def _run_call(client: openai.AsyncOpenAI, http: httpx.AsyncClient, call: Call,
                    tally: Tally) -> None:
    create = (client.chat.completions.create if "messages" in call.body
              else client.completions.create)
    args = {k: v for k, v in call.body.items() if k not in ("ignore_eos",)}
    extra = {"ignore_eos": True} if call.body.get("ignore_eos") else None
    if call.kind == "invalid":
        r = await http.post(call.path, json=call.body)
        assert 400 <= r.status_code < 500 and "error" in r.json(), (r.status_code, r.text)
    elif call.kind == "abort":
        # The client cancels its own call once the request is running (its first chunk came:
        # a call cancelled before the server read it never reaches the engine).
        running = asyncio.Event()

        async def consume() -> None:
            async for _ in await create(**args, extra_body=extra):
                running.set()
        task = asyncio.ensure_future(consume())
        await asyncio.wait([task, asyncio.ensure_future(running.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(call.abort_after_s)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
    elif call.body["stream"]:
        stream = await create(**args, extra_body=extra)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if call.kind == "abandon" and chunks >= call.abandon_after:
                break
        await stream.close()                       # an abandoning client hangs up here
    else:
        out = await create(**args, extra_body=extra)
        if "response_format" in call.body:
            for choice in out.choices:
                if choice.finish_reason == "stop":  # a complete answer is valid JSON
                    obj = json.loads(choice.message.content)
                    assert set(obj) == {"name", "age"}, obj
                    tally.json_answers += 1
    tally.outcomes[call.kind] += 1


async def drive(srv: RemoteServer, model: str, count: int, seed: int) -> Tally:
    rng = random.Random(seed)
    calls = [make_call(rng, model, i) for i in range(count)]
    tally = Tally(calls=count, engine_requests=sum(c.engine_requests for c in calls))
    sem = asyncio.Semaphore(CONCURRENCY)
    # No retries (a lost request must show), and a new connection per call: a kept-alive one
    # can be closed by the server's keep-alive timeout just as the next call is sent on it
    # (a client-side race, not a lost request; seen as connection errors under load).
    client = openai.AsyncOpenAI(base_url=srv.url_v1, api_key="EMPTY", max_retries=0,
                                timeout=CALL_TIMEOUT_S, http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_keepalive_connections=0)))
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=CALL_TIMEOUT_S,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as http:
        async def one(i: int, call: Call) -> None:
            async with sem:
                try:
                    await asyncio.wait_for(_run_call(client, http, call, tally),
                                           CALL_TIMEOUT_S + 5)
                except asyncio.TimeoutError:
                    tally.failures.append((i, "hung", call.kind, call.body))
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    tally.failures.append((i, f"{type(e).__name__}: {e}"[:300], call.kind,
                                           call.body))
        await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
    await client.close()
    return tally


# ---------------------------------------------------------------------- what the server says
def metrics(srv: RemoteServer) -> dict[str, float]:
    totals: dict[str, float] = {}
    text = httpx.get(srv.url_for("/metrics"), timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + s.labels["finished_reason"] + "}"
                            if "finished_reason" in s.labels else "")
            totals[key] = totals.get(key, 0.0) + s.value
    return totals


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def engine_core_pid(srv: RemoteServer) -> int:
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    core = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
    assert len(core) == 1, [(p.pid, p.name()) for p in children]
    return core[0].pid


class RssSampler(threading.Thread):
    """VmRSS of each process every `interval` seconds: the peak between the passes too."""

    def __init__(self, pids: dict[str, int], interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.peak = {name: 0.0 for name in pids}
        self._halt = threading.Event()

    def sample(self) -> dict[str, float]:
        now = {name: vm_rss_mb(pid) for name, pid in self.pids.items()}
        for name, mb in now.items():
            self.peak[name] = max(self.peak[name], mb)
        return now

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def wait_idle(srv: RemoteServer, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(srv)
        if (m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0
                and m["kvserve:kv_cache_usage_perc"] == 0.0):
            return m
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {m}"
        time.sleep(0.2)


def ended(m: dict[str, float]) -> dict[str, int]:
    return {r: int(m[f"kvserve:request_success_total{{{r}}}"]) for r in ("stop", "length", "abort")}


# ---------------------------------------------------------------------- the soak
@pytest.fixture
def soak_server(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> RemoteServer:
    for key in NATIVE_CACHE_ENV:                     # the default environment
        monkeypatch.delenv(key, raising=False)
    srv = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "--uvicorn-log-level", "warning",
                                    "--disable-uvicorn-access-log", "--max-num-seqs", "16",
                                    "--speculative-config", NGRAM])
    try:
        yield srv
    finally:
        srv.close()


def test_soak(soak_server: RemoteServer) -> None:
    """The soak (its numbers: the module's docstring)."""
    srv = soak_server
    model = httpx.get(srv.url_for("/v1/models")).json()["data"][0]["id"]
    per_pass = max(REQUESTS // PASSES, 1)
    sampler = RssSampler({"api_server": srv.proc.pid, "engine_core": engine_core_pid(srv)})
    rss = [sampler.sample()]                          # before any request
    sampler.start()
    t0 = time.monotonic()
    total = Tally()
    engine_requests = 0
    try:
        for p in range(PASSES):                       # the same mix (seed 0) each pass
            tally = asyncio.run(drive(srv, model, per_pass, seed=0))
            wait_idle(srv)
            rss.append(sampler.sample())
            total.calls += tally.calls
            engine_requests += tally.engine_requests
            total.json_answers += tally.json_answers
            total.failures += tally.failures
            for k, v in tally.outcomes.items():
                total.outcomes[k] += v
            print(f"soak pass {p}: {tally.calls} calls, {tally.outcomes}, "
                  f"{time.monotonic() - t0:.0f} s, RSS MB {rss[-1]}", flush=True)
    finally:
        sampler.stop()
    elapsed = time.monotonic() - t0
    m = wait_idle(srv)
    finish = ended(m)
    growth = {name: round(rss[-1][name] - rss[1][name], 1) for name in rss[0]}
    print(f"soak: {total.calls} calls ({engine_requests} engine requests) in {elapsed:.0f} s; "
          f"outcomes {total.outcomes}; {total.json_answers} JSON answers; finish {finish}; "
          f"lost/hung/failed {len(total.failures)}; drafts "
          f"{m.get('kvserve:spec_decode_num_drafts_total', 0):.0f} accepted "
          f"{m.get('kvserve:spec_decode_num_accepted_tokens_total', 0):.0f}; RSS MB start "
          f"{rss[0]}, after warm-up {rss[1]}, end {rss[-1]}, peak {sampler.peak}; growth after "
          f"warm-up {growth} (tolerance {RSS_TOLERANCE_MB})", flush=True)

    assert not total.failures, (len(total.failures), total.failures[:5])
    assert total.outcomes["ok"] + total.outcomes["abandon"] + total.outcomes["abort"] \
        + total.outcomes["invalid"] == total.calls == per_pass * PASSES
    for kind in ("abandon", "abort", "invalid"):
        assert total.outcomes[kind] > 0, total.outcomes
    # Every engine request ended exactly once: none lost (too few), none twice (too many).
    assert sum(finish.values()) == engine_requests, (finish, engine_requests)
    assert finish["abort"] > 0 and finish["stop"] > 0 and finish["length"] > 0, finish
    assert m["kvserve:spec_decode_num_drafts_total"] > 0, m
    assert httpx.get(srv.url_for("/load")).json()["server_load"] == 0
    assert httpx.get(srv.url_for("/health")).status_code == 200
    for name, grew in growth.items():
        assert grew < RSS_TOLERANCE_MB, (name, rss)
    log = srv.log_text()      # each process said what it set, in one line
    for who in ("API server", "Engine core"):
        assert f"{who} memory settings: mallopt MMAP_THRESHOLD" in log, log[-3000:]
