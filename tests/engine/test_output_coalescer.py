"""The engine core process holds back the step outputs of requests that only want their final
output (engine/output_coalescer.py): what it holds and sends (unit tests), and, through a real
engine core process, that the frontend gets the same results from a few messages."""
from __future__ import annotations

from typing import Any

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                   FinishReason)
from kvserve.engine.mp_client import SyncMPClient
from kvserve.engine.output_coalescer import OutputCoalescer
from kvserve.sampling_params import RequestOutputKind
from tests.utils import random_prompts

pytestmark = pytest.mark.timeout(120)

FINAL = RequestOutputKind.FINAL_ONLY


def request(rid: str, kind: RequestOutputKind = FINAL, **kw: Any) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                             sampling_params=SamplingParams(output_kind=kind, **kw),
                             eos_token_ids=[0], arrival_time=0.0)


def out(rid: str, tokens: list[int], finished: bool = False, **kw: Any) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=tokens,
                            finish_reason=FinishReason.LENGTH if finished else None, **kw)


def step(*outputs: EngineCoreOutput, **kw: Any) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outputs), **kw)


def test_holds_after_the_first_token_and_sends_all_at_the_finish() -> None:
    c = OutputCoalescer(log_stats=False)
    c.add_request(request("a"))
    # A prefill chunk without a token may wait; the first token goes out at once, with it.
    assert c.filter(step(out("a", [], events=[(1, 0.5)]))) is None
    sent = c.filter(step(out("a", [7], new_logprobs=[([7], [-0.1], 1)], events=[(2, 1.0)])))
    assert sent is not None and [o.new_token_ids for o in sent.outputs] == [[7]]
    assert sent.outputs[0].events == [(1, 0.5), (2, 1.0)]
    for t in (8, 9):
        assert c.filter(step(out("a", [t], new_logprobs=[([t], [-0.2], 1)]))) is None
    sent = c.filter(step(out("a", [10], finished=True, new_logprobs=[([10], [-0.3], 1)])))
    assert sent is not None and len(sent.outputs) == 1
    o = sent.outputs[0]
    assert o.new_token_ids == [8, 9, 10] and o.finish_reason == FinishReason.LENGTH
    assert o.new_logprobs == [([8], [-0.2], 1), ([9], [-0.2], 1), ([10], [-0.3], 1)]
    assert c.num_tracked() == 0 and c.flush() is None


@pytest.mark.parametrize("why", ["stop strings", "streamed", "stats kept", "turned off"])
def test_sends_every_step_when_someone_reads_it(why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if why == "turned off":
        monkeypatch.setenv("KVSERVE_HOLD_OUTPUTS", "0")
    c = OutputCoalescer(log_stats=why == "stats kept")
    c.add_request(request("a", stop=["x"]) if why == "stop strings"
                  else request("a", RequestOutputKind.DELTA) if why == "streamed"
                  else request("a"))
    for t in range(5):
        sent = c.filter(step(out("a", [t])))
        assert sent is not None and sent.outputs[0].new_token_ids == [t]


def test_another_requests_output_takes_the_held_ones_along_in_order() -> None:
    c = OutputCoalescer(log_stats=False)
    c.add_request(request("a"))
    c.add_request(request("b", RequestOutputKind.DELTA))
    assert c.filter(step(out("a", [1]))) is not None        # first token
    assert c.filter(step(out("a", [2]))) is None
    sent = c.filter(step(out("a", [3]), out("b", [5])))
    assert sent is not None
    assert {o.request_id: o.new_token_ids for o in sent.outputs} == {"a": [2, 3], "b": [5]}


def test_flush_abort_finish_and_time_limit() -> None:
    c = OutputCoalescer(log_stats=False)
    for rid in "abc":
        c.add_request(request(rid))
    c.filter(step(out("a", [1]), out("b", [1]), out("c", [1])))
    assert c.filter(step(out("a", [2]), out("b", [2]), out("c", [2]))) is None
    flushed = c.flush()          # before a utility result: everything held goes first
    assert flushed is not None and sorted(o.request_id for o in flushed.outputs) == list("abc")
    assert c.filter(step(out("a", [3]), out("b", [3]))) is None
    c.drop(["a"])                # aborted by the frontend: its held tokens are moot
    sent = c.filter(step(out("b", [4]), finished_requests={"c"}))
    assert sent is not None and [o.request_id for o in sent.outputs] == ["b"]
    assert sent.outputs[0].new_token_ids == [3, 4]
    c.filter(step(out("b", [5], finished=True)))
    assert c.num_tracked() == 0

    prompt = OutputCoalescer(log_stats=False, max_hold_s=0.0)
    prompt.add_request(request("a"))
    prompt.filter(step(out("a", [1])))
    assert prompt.filter(step(out("a", [2]))) is not None    # held past the limit: sent


# ---------------------------------------------------------------------- a real engine core
def messages_for(llm: LLM, prompts: list[Any], params: SamplingParams) -> tuple[list, list]:
    """Generate, recording each EngineCoreOutputs message the frontend receives."""
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    seen: list[EngineCoreOutputs] = []
    real = client.get_output

    def counting() -> EngineCoreOutputs:
        msg = real()
        seen.append(msg)
        return msg
    client.get_output = counting         # type: ignore[method-assign]
    try:
        return llm.generate(prompts, params, use_tqdm=False), seen
    finally:
        del client.get_output


def test_engine_core_process_sends_few_messages_same_results(tiny_llama: str) -> None:
    kw: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    prompts: list[Any] = random_prompts(3, 20, 40, vocab=1024, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    # A stop string that never matches: the frontend must then see every step.
    every_step = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2,
                                prompt_logprobs=1, stop=["\x00never"])
    llm = LLM(tiny_llama, multiprocessing=True, **kw)
    try:
        held, held_msgs = messages_for(llm, prompts, params)
        ref, ref_msgs = messages_for(llm, prompts, every_step)
        stats = llm.get_stats()
    finally:
        llm.shutdown()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    for h, r in zip(held, ref):
        assert h.outputs[0].token_ids == r.outputs[0].token_ids and len(h.outputs[0].token_ids) == 40
        # (the second run's prefill hits the first's prefix cache: last-bit differences)
        for a, b in zip(h.outputs[0].logprobs + h.prompt_logprobs[1:],
                        r.outputs[0].logprobs + r.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert [a[t].logprob for t in a] == pytest.approx([b[t].logprob for t in a], abs=1e-4)
        assert len(h.prompt_logprobs) == len(r.prompt_logprobs) == len(h.prompt_token_ids)
        assert h.outputs[0].finish_reason == r.outputs[0].finish_reason == "length"
        m = h.metrics
        assert m is not None and m.first_token_time is not None
        assert m.first_token_time < m.last_token_time
    assert len(ref_msgs) >= 40
    # Each request's first token went out alone, at once (its first_token_time is exact).
    firsts = {}
    for msg in held_msgs:
        for o in msg.outputs:
            if o.new_token_ids:
                firsts.setdefault(o.request_id, len(o.new_token_ids))
    assert list(firsts.values()) == [1, 1, 1]
    assert len(held_msgs) <= 12, f"{len(held_msgs)} messages for 3 x 40 tokens"
