"""AsyncLLM: concurrent streams, output kinds, cancellation and abort (all blocks freed),
n > 1, input errors, utilities and the stats hook. One engine (and one event loop) for the
whole module; the references come from the offline LLM."""
from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, Optional

import msgspec
import psutil
import pytest

from kvserve import LLM, EngineArgs, RequestOutput, RequestOutputKind, SamplingParams
from kvserve.engine.async_llm import AsyncLLM
from tests.utils import random_prompts

ENGINE_KW: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)

pytestmark = pytest.mark.timeout(120)

CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)


class StatsRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Optional[dict], Any]] = []

    def __call__(self, scheduler_stats: Optional[dict], iteration_stats: Any) -> None:
        self.calls.append((scheduler_stats, iteration_stats))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def recorder() -> StatsRecorder:
    return StatsRecorder()


@pytest.fixture(scope="module")
def engine(tiny_llama: str, loop: asyncio.AbstractEventLoop, recorder: StatsRecorder):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE_KW),
                                       stat_loggers=[recorder])
    resources = engine.engine_core.resources
    assert resources.proc.pid not in before and os.path.isdir(resources.ipc_dir)
    yield engine
    engine.shutdown()
    assert resources.proc.exitcode == 0          # stopped cleanly by SIGTERM
    assert not os.path.exists(resources.ipc_dir)
    after = {p.pid for p in psutil.Process().children(recursive=True)
             if "resource_tracker" not in " ".join(p.cmdline())}
    assert after <= before


@pytest.fixture(scope="module")
def ref_llm(tiny_llama: str):
    llm = LLM(tiny_llama, multiprocessing=False, **ENGINE_KW)
    yield llm
    llm.shutdown()


def run(loop: asyncio.AbstractEventLoop, coro: Coroutine, timeout: float = 60) -> Any:
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


async def collect(engine: AsyncLLM, prompt: Any, params: SamplingParams,
                  request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


def final_tokens(outs: list[RequestOutput], kind: RequestOutputKind, index: int = 0) -> list[int]:
    """The full token ids of completion `index`, whatever the output kind."""
    if kind == DELTA:
        return [t for o in outs for c in o.outputs if c.index == index for t in c.token_ids]
    return next(c for c in outs[-1].outputs if c.index == index).token_ids


async def assert_idle(engine: AsyncLLM) -> None:
    stats = await engine.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert engine.output_processor.get_num_unfinished_requests() == 0


# ---------------------------------------------------------------------- streams
def test_50_concurrent_streams_match_llm(engine: AsyncLLM, ref_llm: LLM,
                                         loop: asyncio.AbstractEventLoop) -> None:
    prompts = random_prompts(50, 3, 60, vocab=1024, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + (i * 7) % 29,
                             output_kind=(CUMULATIVE, DELTA, FINAL_ONLY)[i % 3])
              for i in range(50)]
    # The offline LLM returns each request's last output: ask it for the whole of it.
    ref = ref_llm.generate(prompts, [msgspec.structs.replace(sp, output_kind=CUMULATIVE)
                                     for sp in params], use_tqdm=False)

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*[collect(engine, p, sp, f"c{i}")
                                      for i, (p, sp) in enumerate(zip(prompts, params))])

    results = run(loop, main())
    for i, (outs, r, sp) in enumerate(zip(results, ref, params)):
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert all(o.request_id == f"c{i}" for o in outs)
        assert final_tokens(outs, sp.output_kind) == r.outputs[0].token_ids, i
        text = ("".join(o.outputs[0].text for o in outs) if sp.output_kind == DELTA
                else outs[-1].outputs[0].text)
        assert text == r.outputs[0].text
        if sp.output_kind == FINAL_ONLY:
            assert len(outs) == 1
    run(loop, assert_idle(engine))


def test_output_kinds(engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
    prompt = "The quick brown fox"

    async def main() -> dict[RequestOutputKind, list[RequestOutput]]:
        kinds = (CUMULATIVE, DELTA, FINAL_ONLY)
        outs = await asyncio.gather(*[
            # 48 tokens: a consumer that lags (a long GC pause in a big test process) gets
            # the newest CUMULATIVE output in place of those it missed; at 12 tokens one
            # full-suite run saw a single output.
            collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=48,
                                                   ignore_eos=True, output_kind=k), f"k{k}")
            for k in kinds])
        return dict(zip(kinds, outs))

    outs = run(loop, main())
    cum, delta, final = outs[CUMULATIVE], outs[DELTA], outs[FINAL_ONLY]
    tokens = final[0].outputs[0].token_ids
    assert len(tokens) == 48 and len(final) == 1 and final[0].finished
    # CUMULATIVE: every output extends the previous one.
    assert len(cum) > 1 and cum[-1].outputs[0].token_ids == tokens
    for a, b in zip(cum, cum[1:]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert tb[:len(ta)] == ta and len(tb) > len(ta)
    # DELTA: disjoint pieces that add up to the whole, text included.
    assert all(o.outputs[0].token_ids for o in delta)
    assert [t for o in delta for t in o.outputs[0].token_ids] == tokens
    assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
    assert cum[-1].outputs[0].text == final[0].outputs[0].text


def test_n_greater_than_one(engine: AsyncLLM, ref_llm: LLM,
                            loop: asyncio.AbstractEventLoop) -> None:
    prompt = [11, 12, 13, 14, 15]

    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True,
                              output_kind=kind)

    ref = ref_llm.generate([prompt], params(FINAL_ONLY), use_tqdm=False)[0]
    ref_tokens = [c.token_ids for c in sorted(ref.outputs, key=lambda c: c.index)]
    assert len({tuple(t) for t in ref_tokens}) > 1      # seeds per child differ

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*[collect(engine, prompt, params(k), f"n{k}")
                                      for k in (CUMULATIVE, DELTA, FINAL_ONLY)])

    cum, delta, final = run(loop, main())
    for kind, outs in ((CUMULATIVE, cum), (DELTA, delta), (FINAL_ONLY, final)):
        assert outs[-1].finished and all(o.request_id == f"n{kind}" for o in outs)
        assert [final_tokens(outs, kind, i) for i in range(3)] == ref_tokens, kind
    assert len(final) == 1 and sorted(c.index for c in final[0].outputs) == [0, 1, 2]
    run(loop, assert_idle(engine))


# ---------------------------------------------------------------------- cancel / abort
def test_cancellation_frees_blocks(engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
    prompts = random_prompts(20, 20, 80, vocab=1024, seed=21)
    long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True, output_kind=DELTA)
    progress: dict[int, int] = {}

    async def consume(i: int) -> int:
        n = 0
        async for out in engine.generate(prompts[i], long, f"x{i}"):
            n += len(out.outputs[0].token_ids)
            progress[i] = n
        return n

    async def main() -> list[Any]:
        tasks = [asyncio.create_task(consume(i)) for i in range(20)]
        # Cancel each even stream once it has produced some tokens (at different points).
        pending = set(range(0, 20, 2))
        while pending:
            for i in list(pending):
                if progress.get(i, 0) >= 2 + i:
                    tasks[i].cancel()
                    pending.discard(i)
            await asyncio.sleep(0.005)
        # And one consumer that walks away mid-stream (closes its generator).
        gen = engine.generate(prompts[1], long, "walk-away")
        await gen.__anext__()
        await gen.aclose()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(loop, main())
    for i, r in enumerate(results):
        if i % 2 == 0:
            assert isinstance(r, asyncio.CancelledError), (i, r)
        else:
            assert r == 150, (i, r)
    run(loop, assert_idle(engine))


def test_abort_by_id(engine: AsyncLLM, loop: asyncio.AbstractEventLoop) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> tuple[list[RequestOutput], list[RequestOutput]]:
        outs_a: list[RequestOutput] = []
        outs_n: list[RequestOutput] = []

        async def stream(rid: str, sp: SamplingParams, into: list[RequestOutput]) -> None:
            async for out in engine.generate([20, 21, 22, 23], sp, rid):
                into.append(out)

        ta = asyncio.create_task(stream("abort-me", params, outs_a))
        tn = asyncio.create_task(stream("abort-n", SamplingParams(
            n=2, temperature=1.0, seed=3, max_tokens=200, ignore_eos=True), outs_n))
        while len(outs_a) < 3 or len(outs_n) < 3:
            await asyncio.sleep(0.005)
        await engine.abort(["abort-me", "abort-n"])
        await asyncio.gather(ta, tn)
        return outs_a, outs_n

    outs_a, outs_n = run(loop, main())
    last = outs_a[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 3 <= len(last.outputs[0].token_ids) < 200
    assert outs_n[-1].finished
    assert [c.finish_reason for c in outs_n[-1].outputs] == ["abort", "abort"]
    run(loop, assert_idle(engine))
    run(loop, engine.abort("no-such-request"))      # unknown ids are ignored


# ---------------------------------------------------------------------- errors
def test_invalid_input_raises_value_error(engine: AsyncLLM,
                                          loop: asyncio.AbstractEventLoop) -> None:
    async def first(prompt: Any, rid: str, **kw: Any) -> None:
        async for _ in engine.generate(prompt, SamplingParams(max_tokens=2, **kw), rid):
            raise AssertionError("streamed before the error")

    with pytest.raises(ValueError, match="empty"):
        run(loop, first("", "e1"))
    with pytest.raises(ValueError, match="maximum model length"):
        run(loop, first(list(range(5, 300)), "e2"))
    with pytest.raises(ValueError, match="out of vocabulary"):
        run(loop, first([5, 10**6], "e3"))

    async def duplicate() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        gen = engine.generate([5, 6, 7], params, "dup")
        await gen.__anext__()
        try:
            with pytest.raises(ValueError, match="already"):
                await first([8, 9], "dup")
        finally:
            await gen.aclose()

    run(loop, duplicate())
    assert engine.is_running and not engine.errored
    run(loop, engine.check_health())
    run(loop, assert_idle(engine))


# ---------------------------------------------------------------------- utilities / stats
def test_utilities_and_stats_hook(engine: AsyncLLM, recorder: StatsRecorder,
                                  loop: asyncio.AbstractEventLoop) -> None:
    start = len(recorder.calls)
    outs = run(loop, collect(engine, [30, 31, 32], SamplingParams(
        temperature=0.0, max_tokens=7, ignore_eos=True, output_kind=DELTA), "stats"))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 7
    calls = recorder.calls[start:]
    assert calls and all(s is not None for s, _ in calls)
    assert sum(it.num_generation_tokens for _, it in calls) == 7
    assert any(s["num_running_reqs"] == 1 for s, _ in calls)
    assert engine.last_scheduler_stats == calls[-1][0]
    assert engine.last_scheduler_stats["num_total_blocks"] == engine.config.cache_config.num_blocks
    assert run(loop, engine.reset_prefix_cache()) is True
    stats = run(loop, engine.get_stats())
    assert stats["num_total_blocks"] == engine.config.cache_config.num_blocks > 0


def test_sync_client_methods_from_another_thread(engine: AsyncLLM,
                                                 loop: asyncio.AbstractEventLoop) -> None:
    """The EngineCoreClient (sync) API of AsyncMPClient, used from a thread while the loop runs."""
    client = engine.engine_core

    async def main() -> dict:
        return await loop.run_in_executor(None, client.call_utility, "get_stats")

    stats = run(loop, main())
    assert stats["num_total_blocks"] == engine.config.cache_config.num_blocks
    with pytest.raises(RuntimeError, match="event loop"):
        client.call_utility("get_stats")      # the loop is not running: refused, not hung
