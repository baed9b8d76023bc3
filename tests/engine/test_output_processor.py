"""OutputProcessor: hand-built engine core outputs in, RequestOutputs (as vLLM shapes them) out."""
from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from kvserve.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from kvserve.engine.output_processor import (OutputProcessor, ParentRequest,
                                             RequestOutputCollector)
from kvserve.model.demo import EOS_ID
from kvserve.outputs import Logprob
from kvserve.sampling_params import RequestOutputKind, SamplingParams
from kvserve.tokenizer import Tokenizer

CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)
TEXT = " the river 東京 and the ocean 🙂 story"


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def out_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(TEXT, add_special_tokens=False)


def _request(tok: Tokenizer, rid: str = "r", prompt: str = "Hello world",
             **params) -> EngineCoreRequest:
    return EngineCoreRequest(rid, tok.encode(prompt), SamplingParams(**params), [EOS_ID],
                             time.time())


def _eco(rid: str, ids: list[int], finish: FinishReason | None = None, stop_reason=None,
         **kw) -> EngineCoreOutput:
    return EngineCoreOutput(rid, list(ids), finish_reason=finish, stop_reason=stop_reason, **kw)


def _run(op: OutputProcessor, rid: str, ids: list[int], finish: FinishReason = FinishReason.LENGTH,
         stop_reason=None) -> list:
    """Feed ids one per step, the last with `finish`; return every RequestOutput."""
    outs = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        res = op.process_outputs([_eco(rid, [t], finish if last else None,
                                       stop_reason if last else None)])
        outs.extend(res.request_outputs)
    return outs


# ---------------------------------------------------------------------- output kinds
def test_cumulative_outputs(tok, out_ids):
    op = OutputProcessor(tok)
    req = _request(tok, output_kind=CUMULATIVE)
    op.add_request(req, "Hello world")
    outs = _run(op, "r", out_ids)
    assert len(outs) == len(out_ids)
    for k, o in enumerate(outs):
        c = o.outputs[0]
        assert c.token_ids == out_ids[:k + 1]
        assert TEXT.startswith(c.text) and c.text == tok.decode(out_ids[:k + 1]).rstrip("\ufffd")
        assert o.finished == (k == len(out_ids) - 1)
        assert o.prompt == "Hello world" and o.prompt_token_ids == req.prompt_token_ids
    final = outs[-1].outputs[0]
    assert final.text == TEXT and final.finish_reason == "length" and final.stop_reason is None
    # Earlier outputs are snapshots: later steps did not change them.
    assert outs[0].outputs[0].token_ids == out_ids[:1]
    assert not op.has_unfinished_requests() and op.get_num_unfinished_requests() == 0


def test_delta_outputs_concatenate_to_the_final_text(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, output_kind=DELTA), None)
    outs = _run(op, "r", out_ids)
    assert "".join(o.outputs[0].text for o in outs) == TEXT
    assert [t for o in outs for t in o.outputs[0].token_ids] == out_ids
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * (len(out_ids) - 1) + [True]
    assert outs[-1].outputs[0].finish_reason == "length"


def test_final_only_returns_one_output(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, output_kind=FINAL_ONLY), "Hello world")
    outs = _run(op, "r", out_ids)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == TEXT and outs[0].outputs[0].token_ids == out_ids


def test_multi_token_steps(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, output_kind=DELTA), None)
    res1 = op.process_outputs([_eco("r", out_ids[:4])])
    res2 = op.process_outputs([_eco("r", out_ids[4:], FinishReason.LENGTH)])
    [o1], [o2] = res1.request_outputs, res2.request_outputs
    assert o1.outputs[0].token_ids == out_ids[:4] and o2.outputs[0].token_ids == out_ids[4:]
    assert o1.outputs[0].text + o2.outputs[0].text == TEXT


# ---------------------------------------------------------------------- stop conditions
def test_stop_string_truncates_and_requests_abort(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, stop=["and the", "never"]), None)
    to_abort, outs = [], []
    for t in out_ids:
        res = op.process_outputs([_eco("r", [t])])
        to_abort += res.reqs_to_abort
        outs += res.request_outputs
        if res.reqs_to_abort:
            break
    final = outs[-1]
    assert to_abort == ["r"] and final.finished
    c = final.outputs[0]
    assert c.text == " the river 東京 " and c.finish_reason == "stop" and c.stop_reason == "and the"
    assert tok.decode(c.token_ids).startswith(" the river 東京 and the")
    # Streamed text never showed part of the stop string.
    assert all(not o.outputs[0].text.endswith(("a", "an", "and")) for o in outs[:-1])
    # Outputs still in flight from the core for the finished request are ignored.
    assert op.process_outputs([_eco("r", [5])]).request_outputs == []
    assert not op.has_unfinished_requests()


def test_stop_string_inside_one_multi_token_step(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, stop=["river"], include_stop_str_in_output=True), None)
    res = op.process_outputs([_eco("r", out_ids)])
    assert res.reqs_to_abort == ["r"]
    c = res.request_outputs[0].outputs[0]
    assert c.text == " the river" and c.stop_reason == "river" and c.token_ids == out_ids


def test_stop_string_on_the_engines_last_step_needs_no_abort(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, stop=["ocean"]), None)
    res = op.process_outputs([_eco("r", out_ids, FinishReason.LENGTH)])
    assert res.reqs_to_abort == []          # the core already finished it
    c = res.request_outputs[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "ocean"
    assert c.text == " the river 東京 and the "


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_eos_stays_in_token_ids_but_not_in_text(tok, out_ids, skip_special_tokens):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, skip_special_tokens=skip_special_tokens), None)
    outs = _run(op, "r", out_ids + [EOS_ID], FinishReason.STOP, None)
    c = outs[-1].outputs[0]
    assert c.token_ids == out_ids + [EOS_ID]
    assert c.text == TEXT and c.finish_reason == "stop" and c.stop_reason is None


def test_eos_text_with_include_stop_str_in_output(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, skip_special_tokens=False, include_stop_str_in_output=True), None)
    c = _run(op, "r", out_ids + [EOS_ID], FinishReason.STOP)[-1].outputs[0]
    assert c.text == TEXT + "</s>"


def test_stop_token_id_is_the_stop_reason(tok, out_ids):
    stop_id = out_ids[3]
    op = OutputProcessor(tok)
    op.add_request(_request(tok, stop_token_ids=[stop_id]), None)
    c = _run(op, "r", out_ids[:4], FinishReason.STOP, stop_id)[-1].outputs[0]
    assert c.stop_reason == stop_id and c.finish_reason == "stop"
    assert c.token_ids == out_ids[:4] and c.text == tok.decode(out_ids[:3])


# ---------------------------------------------------------------------- logprobs
def _lp_entry(rng: random.Random, sampled: int, k: int, vocab: int) -> tuple:
    top = rng.sample(range(vocab), k)
    lps = sorted((math.log(rng.random()) for _ in range(k + 1)), reverse=True)
    rank = top.index(sampled) + 1 if sampled in top else k + 1 + rng.randrange(5)
    return [sampled] + top, [lps[rank - 1] if sampled in top else lps[-1] - 1.0] + lps[:k], rank


def test_logprobs_dicts_and_cumulative_logprob(tok, out_ids):
    rng = random.Random(0)
    k = 3
    op = OutputProcessor(tok)
    op.add_request(_request(tok, logprobs=k, output_kind=DELTA), None)
    entries, deltas = [], []
    for i, t in enumerate(out_ids):
        entry = _lp_entry(rng, t, k, tok.vocab_size)
        if i == 2:   # the sampled token is also in the top-k
            entry = ([t, t, 7, 8], [-0.1, -0.1, -2.0, -3.0], 1)
        entries.append(entry)
        last = i == len(out_ids) - 1
        res = op.process_outputs([_eco("r", [t], FinishReason.LENGTH if last else None,
                                       new_logprobs=[entry])])
        deltas += res.request_outputs
    got = [d for o in deltas for d in o.outputs[0].logprobs]
    assert all(len(o.outputs[0].logprobs) == 1 for o in deltas)   # DELTA: this step's only
    assert len(got) == len(out_ids)
    for pos, ((ids, lps, rank), d) in enumerate(zip(entries, got)):
        assert list(d) == list(dict.fromkeys(ids))        # sampled first, then the top-k
        assert d[ids[0]] == Logprob(lps[0], rank, tok.decode([ids[0]], skip_special_tokens=False))
        for j, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            assert d[t].logprob == lp and d[t].rank == j
            assert d[t].decoded_token == tok.decode([t], skip_special_tokens=False)
    assert len(got[2]) == k
    expected_cum = sum(e[1][0] for e in entries)
    assert deltas[-1].outputs[0].cumulative_logprob == pytest.approx(expected_cum)


def test_no_logprobs_requested(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok), None)
    c = _run(op, "r", out_ids)[-1].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_prompt_logprobs_accumulate_across_prefill_chunks(tok, out_ids, kind):
    req = _request(tok, prompt=" the river and the ocean", prompt_logprobs=2, output_kind=kind)
    prompt = req.prompt_token_ids
    rng = random.Random(1)
    entries = [_lp_entry(rng, t, 2, tok.vocab_size) for t in prompt[1:]]
    op = OutputProcessor(tok)
    op.add_request(req, None)
    # Two prefill chunks: the first reports nothing (no token yet), the second the first token.
    res = op.process_outputs([_eco("r", [], new_prompt_logprobs=entries[:3])])
    assert res.request_outputs == []
    res = op.process_outputs([_eco("r", out_ids[:1], new_prompt_logprobs=entries[3:])])
    plp = res.request_outputs[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for pos in range(1, len(prompt)):
        ids, lps, rank = entries[pos - 1]
        assert plp[pos][prompt[pos]] == Logprob(lps[0], rank, tok.decode([prompt[pos]]))
        assert {t: v.rank for t, v in plp[pos].items() if t != prompt[pos]} == {
            t: j for j, t in enumerate(ids[1:], 1) if t != prompt[pos]}
    res = op.process_outputs([_eco("r", out_ids[1:2], FinishReason.LENGTH)])
    later = res.request_outputs[0].prompt_logprobs
    assert later is None if kind == DELTA else later == plp   # DELTA sends them once


# ---------------------------------------------------------------------- n > 1
def _parent(tok: Tokenizer, n: int, **params) -> tuple[ParentRequest, list[EngineCoreRequest]]:
    sp = SamplingParams(n=n, **params)
    req = EngineCoreRequest("p", tok.encode("Hello"), sp, [EOS_ID], time.time())
    parent = ParentRequest("p", sp)
    return parent, [parent.make_child_request(req, i) for i in range(n)]


def test_parent_request_children(tok):
    parent, children = _parent(tok, 3, seed=10, prompt_logprobs=1)
    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in children] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for c in children)
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None]
    assert all(c.prompt_token_ids == children[0].prompt_token_ids for c in children)
    _, unseeded = _parent(tok, 2)
    assert [c.sampling_params.seed for c in unseeded] == [None, None]


def _feed_children(op, children, texts, tok, rng) -> list:
    """Interleave the children's tokens in a random order, several children per step."""
    pending = {c.request_id: tok.encode(t, add_special_tokens=False)
               for c, t in zip(children, texts)}
    outs = []
    while pending:
        step = []
        for rid in rng.sample(sorted(pending), rng.randrange(1, len(pending) + 1)):
            ids = pending[rid]
            t, pending[rid] = ids[0], ids[1:]
            step.append(_eco(rid, [t], FinishReason.LENGTH if not pending[rid] else None))
            if not pending[rid]:
                del pending[rid]
        outs += op.process_outputs(step).request_outputs
    return outs


TEXTS = [" the river", " and the ocean 🙂 story", " 東京"]


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_n_gt_1_assembles_one_output(tok, kind):
    parent, children = _parent(tok, 3, output_kind=kind)
    op = OutputProcessor(tok)
    for i, c in enumerate(children):
        op.add_request(c, "Hello", parent, i)
    assert op.get_num_unfinished_requests() == 3
    outs = _feed_children(op, children, TEXTS, tok, random.Random(5))
    assert all(o.request_id == "p" for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    for o in outs:
        idx = [c.index for c in o.outputs]
        assert idx == sorted(idx) and len(set(idx)) == len(idx)
    final = outs[-1]
    if kind == FINAL_ONLY:
        assert len(outs) == 1
    if kind == DELTA:
        texts = {i: "" for i in range(3)}
        for o in outs:
            for c in o.outputs:
                texts[c.index] += c.text
        assert [texts[i] for i in range(3)] == TEXTS
    else:
        assert [c.index for c in final.outputs] == [0, 1, 2]
        assert [c.text for c in final.outputs] == TEXTS
        assert all(c.finish_reason == "length" for c in final.outputs)
    assert final.prompt == "Hello" and final.prompt_token_ids == children[0].prompt_token_ids
    assert not op.has_unfinished_requests()


def test_n_gt_1_stop_string_in_one_child(tok):
    parent, children = _parent(tok, 2, stop=["river"], output_kind=FINAL_ONLY)
    op = OutputProcessor(tok)
    for i, c in enumerate(children):
        op.add_request(c, None, parent, i)
    res = op.process_outputs([_eco("1_p", tok.encode(" a river", add_special_tokens=False)),
                              _eco("0_p", tok.encode(" the", add_special_tokens=False))])
    assert res.reqs_to_abort == ["1_p"] and res.request_outputs == []
    res = op.process_outputs([_eco("0_p", tok.encode(" sea", add_special_tokens=False),
                                   FinishReason.LENGTH)])
    [out] = res.request_outputs
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [
        (0, " the sea", "length"), (1, " a ", "stop")]


def test_add_request_with_n_gt_1_needs_children(tok):
    sp = SamplingParams(n=2)
    with pytest.raises(ValueError, match="n=2"):
        OutputProcessor(tok).add_request(EngineCoreRequest("x", [1, 5], sp, [2], 0.0), None)


# ---------------------------------------------------------------------- abort / metrics / stats
def test_abort_requests(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, "a"), None)
    parent, children = _parent(tok, 2, output_kind=FINAL_ONLY)
    for i, c in enumerate(children):
        op.add_request(c, None, parent, i)
    op.process_outputs([_eco("a", out_ids[:2]), _eco("0_p", out_ids[:1]), _eco("1_p", out_ids[:3])])
    outs = op.abort_requests(["a", "p", "unknown"])
    assert sorted(op.last_aborted_child_ids) == ["0_p", "1_p", "a"]
    by_id = {o.request_id: o for o in outs}
    assert set(by_id) == {"a", "p"} and all(o.finished for o in outs)
    assert by_id["a"].outputs[0].finish_reason == "abort"
    assert by_id["a"].outputs[0].text == tok.decode(out_ids[:2])
    assert [(c.index, c.token_ids, c.finish_reason) for c in by_id["p"].outputs] == [
        (0, out_ids[:1], "abort"), (1, out_ids[:3], "abort")]
    assert not op.has_unfinished_requests()
    assert op.abort_requests(["a"]) == [] and op.last_aborted_child_ids == []


def test_engine_abort_and_error_finish_reasons(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, "a"), None)
    op.add_request(_request(tok, "b"), None)
    res = op.process_outputs([_eco("a", [], FinishReason.ABORT),
                              _eco("b", out_ids[:1], FinishReason.ERROR)])
    assert [(o.request_id, o.outputs[0].finish_reason) for o in res.request_outputs] == [
        ("a", "abort"), ("b", "error")]


def test_metrics_timestamps(tok, out_ids):
    before = time.time()
    op = OutputProcessor(tok)
    req = _request(tok)
    op.add_request(req, None)
    outs = _run(op, "r", out_ids[:3])
    m = outs[-1].metrics
    assert m.arrival_time == req.arrival_time
    assert before <= m.first_token_time <= m.last_token_time <= m.finished_time <= time.time()
    assert outs[0].metrics.finished_time is None
    assert outs[0].metrics.first_token_time == m.first_token_time


def test_iteration_stats(tok, out_ids):
    op = OutputProcessor(tok, log_stats=True)
    op.add_request(_request(tok, "a"), None)
    op.add_request(_request(tok, "b"), None)
    s1 = op.process_outputs([_eco("a", out_ids[:1]), _eco("b", out_ids[:2])]).iteration_stats
    assert s1.num_generation_tokens == 3 and len(s1.time_to_first_tokens_iter) == 2
    assert s1.num_prompt_tokens == 2 * len(_request(tok).prompt_token_ids)
    s2 = op.process_outputs([_eco("a", out_ids[1:2], FinishReason.LENGTH)]).iteration_stats
    assert s2.num_generation_tokens == 1 and len(s2.inter_token_latencies_iter) == 1
    [fin] = s2.finished_requests
    assert fin.finish_reason == "length" and fin.num_generation_tokens == 2 and fin.e2e_latency >= 0
    assert OutputProcessor(tok).process_outputs([]).iteration_stats is None


def test_detokenize_false_gives_ids_only(tok, out_ids):
    op = OutputProcessor(tok)
    op.add_request(_request(tok, detokenize=False, logprobs=0), None)
    res = op.process_outputs([_eco("r", out_ids[:2], FinishReason.LENGTH,
                                   new_logprobs=[([t], [-1.0], 4) for t in out_ids[:2]])])
    c = res.request_outputs[0].outputs[0]
    assert c.text == "" and c.token_ids == out_ids[:2]
    assert c.logprobs == [{t: Logprob(-1.0, 4, None)} for t in out_ids[:2]]


def test_output_collector_merges_deltas(tok, out_ids):
    async def main() -> None:
        op = OutputProcessor(tok)
        req = _request(tok, output_kind=DELTA)
        q = RequestOutputCollector(DELTA)
        op.add_request(req, None, queue=q)
        for i, t in enumerate(out_ids):
            last = i == len(out_ids) - 1
            res = op.process_outputs([_eco("r", [t], FinishReason.LENGTH if last else None)])
            assert res.request_outputs == []      # delivered to the queue instead
        merged = await asyncio.wait_for(q.get(), 5)
        assert merged.finished and merged.outputs[0].text == TEXT
        assert merged.outputs[0].token_ids == out_ids and q.get_nowait() is None
    asyncio.run(main())
