"""Data parallelism behind `kvserve serve -dp 2`: two engine cores, one DP coordinator, one
API server. Load balancing spreads concurrent requests over both engines (seen in the
per-engine metrics), greedy texts equal a single engine's. A killed engine is the whole
server's death by default (vLLM's: tests/reliability/test_kill_under_load.py); with
`--keep-alive-on-engine-death` it turns /health into 503 and fails only its own requests, the
other engine serving on.
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import psutil
import pytest

from kvserve.engine.dp_core import _ALL_REDUCE_EVERY
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.entrypoints.conftest import SERVER_ENGINE_ARGS, RemoteServer

NUM_REQUESTS = 48


def _stop_and_check_nothing_left(server: RemoteServer) -> None:
    """SIGTERM: the server, both engines and the coordinator exit on their own."""
    assert server.terminate(timeout=30) is not None, server.log_text()[-3000:]
    deadline = time.monotonic() + 10
    while server.session_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server.session_alive()
MAX_TOKENS = 8


def _prompts_and_reference(model: str, num_requests: int,
                           max_tokens: int) -> tuple[list[str], list[str]]:
    """The DP tests' prompts and one in-process engine's greedy texts for them."""
    prompts = [f"request {i}: the quick brown fox {i * 7}" for i in range(num_requests)]
    with LLM(model, dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
             multiprocessing=False) as llm:
        reference = [o.outputs[0].text for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            use_tqdm=False)]
    return prompts, reference


def _engines(server: RemoteServer) -> dict[str, psutil.Process]:
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    return {p.name(): p for p in procs if p.name().startswith(("KVSEngine_DP", "KVSDPCoord"))}


def _generation_tokens(server: RemoteServer) -> dict[str, float]:
    return _parse_generation_tokens(httpx.get(server.url_for("/metrics"), timeout=10).text)


def _parse_generation_tokens(text: str) -> dict[str, float]:
    found = re.findall(r'^kvserve:generation_tokens_total\{engine="(\d+)"[^}]*\} ([0-9.e+]+)$',
                       text, flags=re.M)
    return {engine: float(value) for engine, value in found}


async def _complete_all(server: RemoteServer, model: str, prompts: list[str],
                        max_tokens: int) -> list:
    client = openai.AsyncOpenAI(base_url=server.url_v1, api_key="EMPTY", max_retries=0,
                                timeout=120)
    try:
        return await asyncio.gather(*(
            client.completions.create(model=model, prompt=p, max_tokens=max_tokens,
                                      temperature=0.0, extra_body={"ignore_eos": True})
            for p in prompts), return_exceptions=True)
    finally:
        await client.close()


@pytest.mark.timeout(240)
def test_dp2_serves_balanced_and_matches_one_engine(tiny_llama: str) -> None:
    prompts, reference = _prompts_and_reference(tiny_llama, NUM_REQUESTS, MAX_TOKENS)
    server = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "-dp", "2"])
    try:
        assert sorted(_engines(server)) == ["KVSDPCoord", "KVSEngine_DP0", "KVSEngine_DP1"]
        results = asyncio.run(_complete_all(server, tiny_llama, prompts, MAX_TOKENS))
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, errors[:3]
        assert [r.choices[0].text for r in results] == reference
        tokens = _generation_tokens(server)
        assert sum(tokens.values()) == NUM_REQUESTS * MAX_TOKENS
        assert tokens.get("0", 0) > 0 and tokens.get("1", 0) > 0, tokens
        # A second burst after the wave ended: the engines start a new wave together.
        results = asyncio.run(_complete_all(server, tiny_llama, prompts[:4], MAX_TOKENS))
        assert [r.choices[0].text for r in results] == reference[:4]
        _stop_and_check_nothing_left(server)
    finally:
        server.close()


@pytest.mark.timeout(240)
def test_keep_alive_killed_dp_engine_503_and_only_its_requests_fail(tiny_llama: str) -> None:
    server = RemoteServer(tiny_llama, [*SERVER_ENGINE_ARGS, "-dp", "2",
                                       "--keep-alive-on-engine-death"])
    try:
        model = tiny_llama
        victim = _engines(server)["KVSEngine_DP1"]
        prompts = [f"long request {i}" for i in range(8)]
        # Long enough to be under way when killed: ~200 steps, and the kill comes as soon as
        # the victim has produced its first tokens (a fixed sleep raced fast machines).
        max_tokens = 6 * _ALL_REDUCE_EVERY

        async def run() -> list:
            task = asyncio.ensure_future(_complete_all(server, model, prompts, max_tokens))
            async with httpx.AsyncClient() as http:
                deadline = time.monotonic() + 60
                while _parse_generation_tokens(
                        (await http.get(server.url_for("/metrics"))).text).get("1", 0) == 0:
                    assert time.monotonic() < deadline, "the victim engine never generated"
                    await asyncio.sleep(0.02)
                os.kill(victim.pid, signal.SIGKILL)
                killed = time.monotonic()
                while (await http.get(server.url_for("/health"))).status_code != 503:
                    assert time.monotonic() - killed < 5.0, "/health still 200 after 5 s"
                    await asyncio.sleep(0.1)
            return await task

        results = asyncio.run(run())
        failed = [r for r in results if isinstance(r, BaseException)]
        done = [r for r in results if not isinstance(r, BaseException)]
        # Both engines had requests: the dead one's fail (503), the live one's complete.
        assert failed and done, results
        assert all(isinstance(e, openai.APIStatusError) and e.status_code == 503
                   and "died" in str(e) for e in failed), failed
        assert all(len(r.choices[0].text) > 0 and r.usage.completion_tokens == max_tokens
                   for r in done)
        # The survivor keeps serving new requests.
        again = asyncio.run(_complete_all(server, model, ["after the crash"], 4))
        assert not isinstance(again[0], BaseException), again
        _stop_and_check_nothing_left(server)
    finally:
        server.close()
