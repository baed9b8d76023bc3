"""The Scheduler on its own: driven with ModelRunnerOutputs made up by the test (no model), so
each rule is checked step by step instead of only through end-to-end outputs."""
from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np
import pytest
import torch

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sched_hooks import SchedulerHook
from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

EOS = 2


def make_scheduler(num_blocks: int = 64, block_size: int = 4, hooks: tuple = (),
                   **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(**config),
                     CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                 enable_prefix_caching=False), hooks=hooks)


def request(rid: str, prompt_len: int, priority: int = 0, max_tokens: int = 32,
            **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(10, 10 + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids={EOS}, arrival_time=time.time(), priority=priority)


def runner_output(sched: Scheduler, so: SchedulerOutput, token: int = 7,
                  tokens: Optional[dict[str, list[int]]] = None, **extra) -> ModelRunnerOutput:
    """What the workers would return: `token` for each request whose computed tokens caught up
    with its tokens (nothing for a prefill chunk), or `tokens[rid]` where given."""
    ids = list(so.num_scheduled_tokens)
    tokens = tokens or {}
    sampled = []
    for rid in ids:
        req = sched.requests[rid]
        samples = req.num_computed_tokens >= req.num_tokens
        sampled.append(tokens.get(rid, [token]) if samples else [])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra)


def step(sched: Scheduler, **kw) -> SchedulerOutput:
    so = sched.schedule()
    sched.update_from_output(so, runner_output(sched, so, **kw))
    return so


# ---- preemption ------------------------------------------------------------------------------

def test_preemption_takes_the_lowest_priority_and_keeps_the_later_requests() -> None:
    """Decodes outgrow the cache: the victim is the lowest-priority request although it runs
    first, its tokens of this step are given back, and the requests after the one that
    preempted it are still served (the loop's index moves down with the removed request)."""
    sched = make_scheduler(num_blocks=6, policy="priority")
    sched.add_request(request("low", 4, priority=1))
    step(sched)                                              # low: 4 prompt tokens + 1 sampled
    for i in range(3):
        sched.add_request(request(f"h{i}", 4, priority=0))
    so = step(sched)                                         # low decodes; h0-h2 prefill
    assert so.num_scheduled_tokens == {"low": 1, "h0": 4, "h1": 4, "h2": 4}
    assert sched.kv_cache_manager.num_free_blocks == 1
    # Each h now needs a second block: h0 takes the last one, h1 preempts low.
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"h0": 1, "h1": 1, "h2": 1}
    assert so.total_num_scheduled_tokens == 3
    assert so.preempted_req_ids == {"low"}
    low = sched.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert [r.request_id for r in sched.running] == ["h0", "h1", "h2"]
    assert sched.waiting.peek() is low and sched.num_preemptions == 1
    sched.update_from_output(so, runner_output(sched, so))
    # low comes back when there is room, recomputing its prompt and its output token.
    for rid in ("h0", "h1", "h2"):
        sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    so = sched.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["low"]
    assert so.scheduled_new_reqs[0].token_ids == list(range(10, 14)) + [7, 7]
    assert so.num_scheduled_tokens == {"low": 6}


def test_fcfs_preempts_the_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    for i in range(4):
        sched.add_request(request(f"r{i}", 4))
    step(sched)                                              # 4 blocks, all full
    so = sched.schedule()                                    # r0 needs a block: r3 goes
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1}   # r1 preempted r2
    assert so.preempted_req_ids == {"r2", "r3"}
    assert sched.requests["r2"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]


# ---- chunked prefill -------------------------------------------------------------------------

def test_chunked_prefill_fills_the_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    for i in range(3):
        sched.add_request(request(f"r{i}", 6))
    so = step(sched)
    assert so.num_scheduled_tokens == {"r0": 6, "r1": 2}     # r1's prompt is chunked
    assert so.scheduled_new_reqs[1].num_computed_tokens == 0
    so = step(sched)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 3}
    cached = so.scheduled_cached_reqs
    assert cached.num_computed_tokens[cached.req_ids.index("r1")] == 2
    so = step(sched)
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 3}
    assert sched.requests["r1"].output_token_ids == [7, 7]
    assert sched.requests["r2"].output_token_ids == [7]


def test_long_prefill_threshold_and_no_chunking() -> None:
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sched.add_request(request("r0", 12))
    assert [step(sched).num_scheduled_tokens["r0"] for _ in range(3)] == [5, 5, 2]
    # Without chunked prefill a prompt over the budget waits for a step where it fits whole.
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add_request(request("r0", 5))
    sched.add_request(request("r1", 5))
    assert step(sched).num_scheduled_tokens == {"r0": 5}
    assert step(sched).num_scheduled_tokens == {"r0": 1, "r1": 5}


# ---- pipeline parallelism: batches in flight --------------------------------------------------

def test_requests_in_flight_are_neither_scheduled_nor_preempted() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_model_len=64),
                      CacheConfig(block_size=4, num_blocks=4, enable_prefix_caching=False),
                      send_sampled_tokens=True)
    for i, n in enumerate((8, 6, 4)):
        sched.add_request(request(f"r{i}", n))
    first = sched.schedule()                                 # r0 + 2 tokens of r1
    assert first.num_scheduled_tokens == {"r0": 8, "r1": 2}
    second = sched.schedule()                                # r2 only: r0, r1 are in flight
    assert second.num_scheduled_tokens == {"r2": 4}
    assert sched.schedule().is_empty
    sched.update_from_output(first, runner_output(sched, first, token=9))
    # r0 decodes into a third block; none is free and r2 (in flight) may not be preempted.
    assert sched.kv_cache_manager.num_free_blocks == 0
    third = sched.schedule()
    assert third.preempted_req_ids == {"r1"}                 # in flight: r2 is kept
    assert third.num_scheduled_tokens == {"r0": 1}
    cached = third.scheduled_cached_reqs                      # every stage learns r0's token
    assert cached.req_ids == ["r0"] and cached.new_token_ids == [[9]]
    sched.update_from_output(second, runner_output(sched, second, token=5))
    sched.update_from_output(third, runner_output(sched, third, token=6))
    assert sched.requests["r0"].output_token_ids == [9, 6]
    assert sched.requests["r2"].output_token_ids == [5]


# ---- speculative decoding: draft rollback ----------------------------------------------------

@pytest.fixture
def spec_hook():
    from kvserve.spec_decode import make_spec_decode_controller
    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.scheduling import SpecDecodeScheduling
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2,
                             min_acceptance_rate=0.0)
    return SpecDecodeScheduling(3, make_spec_decode_controller(spec), max_model_len=256)


def test_rejected_drafts_roll_back_and_their_slots_are_reused(spec_hook) -> None:
    sched = make_scheduler(hooks=(spec_hook,))
    sched.add_request(request("r0", 4))
    so = sched.schedule()
    sched.update_from_output(so, runner_output(sched, so, token=20, spec_token_ids=[[21, 22, 23]]))
    blocks = list(sched.kv_cache_manager.get_block_ids("r0"))
    assert len(blocks) == 1
    # The decode token + 3 drafts: positions 4..7, one more block.
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 4}
    assert so.scheduled_spec_decode_tokens == {"r0": [21, 22, 23]}
    assert len(sched.kv_cache_manager.get_block_ids("r0")) == 2
    # Draft 21 accepted, 22 rejected (the target said 30): 2 tokens out, 2 positions back.
    sched.update_from_output(so, runner_output(sched, so, tokens={"r0": [21, 30]},
                                               spec_token_ids=[[]]))
    r0 = sched.requests["r0"]
    assert r0.output_token_ids == [20, 21, 30]
    assert r0.num_computed_tokens == r0.num_tokens - 1 == 6
    assert sched.make_stats().to_dict()["spec_decoding"]["num_accepted_tokens_per_pos"] == [1, 0, 0]
    # The next decode writes position 6 into the block the rejected drafts had: no new block.
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r0": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [[]]
    assert sched.kv_cache_manager.get_block_ids("r0")[:1] == blocks
    assert len(sched.kv_cache_manager.get_block_ids("r0")) == 2


def test_drafts_stop_at_max_tokens_and_the_budget(spec_hook) -> None:
    sched = make_scheduler(hooks=(spec_hook,), max_num_batched_tokens=3)
    sched.add_request(request("r0", 2, max_tokens=3))
    so = sched.schedule()
    sched.update_from_output(so, runner_output(sched, so, spec_token_ids=[[21, 22, 23]]))
    so = sched.schedule()          # 1 output so far, max_tokens 3: one draft + the bonus token
    assert so.scheduled_spec_decode_tokens == {"r0": [21]}
    assert so.num_scheduled_tokens == {"r0": 2}


# ---- structured outputs: the grammar advances -----------------------------------------------

@pytest.fixture(scope="module")
def engine_config(tiny_llama: str):
    from kvserve.engine.arg_utils import EngineArgs
    return EngineArgs(model=tiny_llama, max_model_len=256).create_engine_config()


def test_grammar_advances_over_sampled_tokens_and_jumps_forward(engine_config) -> None:
    from kvserve.structured_output.bitmask import unpack_bitmask
    from kvserve.structured_output.manager import StructuredOutputManager
    from kvserve.structured_output.scheduling import StructuredOutputScheduling
    from kvserve.tokenizer import Tokenizer
    manager = StructuredOutputManager(engine_config)
    try:
        hook = StructuredOutputScheduling(manager, 256, enable_jump_forward=True)
        sched = make_scheduler(hooks=(hook,))
        tok = Tokenizer.from_pretrained(engine_config.model_config.tokenizer)
        choices = ["red fox", "green tea"]
        sched.add_request(request("c", 3, ignore_eos=True,
                                  structured_outputs=StructuredOutputsParams(choice=choices)))
        assert sched.requests["c"].status == RequestStatus.WAITING_FOR_FSM
        deadline = time.monotonic() + 10
        so = sched.schedule()
        while so.is_empty and time.monotonic() < deadline:   # the grammar compiles
            so = sched.schedule()
        assert so.num_scheduled_tokens == {"c": 3}
        vocab = engine_config.model_config.vocab_size

        def allowed(out: SchedulerOutput) -> set[int]:
            assert out.structured_output_request_ids == ["c"]
            mask = unpack_bitmask(torch.from_numpy(out.grammar_bitmask), vocab)[0]
            return set(np.flatnonzero(mask.numpy()).tolist())

        green = tok.encode("green tea", add_special_tokens=False)
        assert green[0] in allowed(so)
        outs = sched.update_from_output(so, runner_output(sched, so, token=green[0])).outputs
        # "g" decides the choice: the grammar forces the rest (but the last token, which a
        # longer string could merge with); the model never computes them.
        forced = outs[0].new_token_ids[1:]
        assert forced and green[0:1 + len(forced)] == outs[0].new_token_ids
        so = sched.schedule()
        assert so.scheduled_cached_reqs.new_token_ids == [forced]   # the workers learn them
        rest = green[1 + len(forced):]
        assert rest and rest[0] in allowed(so) and green[0] not in allowed(so)
        for t in rest:
            sched.update_from_output(so, runner_output(sched, so, token=t))
            so = sched.schedule()
        # The choice is complete: only a stop token may follow, and (EOS ignored) it is the
        # grammar's end that stops the request.
        eos = sorted(tok.eos_token_ids)
        assert allowed(so) == set(eos)
        outs = sched.update_from_output(so, runner_output(sched, so, token=eos[0])).outputs
        assert str(outs[0].finish_reason) == "stop"
        assert tok.decode(green) == "green tea" and "c" not in sched.requests
        assert manager.num_active == 0
    finally:
        manager.shutdown()


# ---- KV transfer: admission after a remote load ------------------------------------------------

def test_request_waiting_for_remote_kv_is_admitted_after_its_load(tiny_llama: str,
                                                                 tmp_path) -> None:
    from kvserve.engine.arg_utils import EngineArgs
    from kvserve.kv_transfer.base import KVConnectorOutput, KVConnectorRole
    from kvserve.kv_transfer.factory import KVConnectorFactory
    from kvserve.kv_transfer.scheduling import KVTransferScheduling
    config = EngineArgs(model=tiny_llama, max_model_len=256, block_size=4, kv_transfer_config={
        "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    ).create_engine_config()
    connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER)
    hook = KVTransferScheduling(connector)
    sched = make_scheduler(hooks=(hook,))
    remote = request("remote", 10)
    for key in connector._block_keys(remote.prompt_token_ids, None, 2):   # 2 blocks stored
        os.makedirs(os.path.dirname(connector._file(key)), exist_ok=True)
        open(connector._file(key), "wb").close()
    sched.add_request(remote)
    sched.add_request(request("local", 3))
    so = sched.schedule()
    # The load starts (its blocks allocated); the other request is not held up by it.
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert so.num_scheduled_tokens == {"local": 3}
    assert set(so.kv_connector_metadata.loads) == {"remote"}
    assert len(sched.kv_cache_manager.get_block_ids("remote")) == 2
    sched.update_from_output(so, runner_output(sched, so, kv_connector_output=KVConnectorOutput(
        num_started=1, num_in_flight=1)))
    so = step(sched, kv_connector_output=KVConnectorOutput(num_in_flight=1))
    assert "remote" not in so.num_scheduled_tokens          # still loading
    so = sched.schedule()
    sched.update_from_output(so, runner_output(sched, so, kv_connector_output=KVConnectorOutput(
        finished_recving={"remote"}, num_transfers=1)))
    so = sched.schedule()
    # Admitted with the 8 loaded tokens computed: only the rest of its prompt runs.
    assert so.num_scheduled_tokens["remote"] == 2
    new = {n.req_id: n for n in so.scheduled_new_reqs}["remote"]
    assert new.num_computed_tokens == 8
    assert remote.status == RequestStatus.RUNNING and remote.num_cached_tokens == 8
    stats = sched.make_stats().to_dict()
    assert stats["external_prefix_cache_hits"] == 8 and stats["num_waiting_for_remote_kvs"] == 0


def test_the_hook_interface_defaults_change_nothing() -> None:
    """A scheduler with a do-nothing hook schedules exactly as one without."""
    plain, hooked = make_scheduler(max_num_batched_tokens=8), make_scheduler(
        max_num_batched_tokens=8, hooks=(SchedulerHook(),))
    for sched in (plain, hooked):
        for i in range(3):
            sched.add_request(request(f"r{i}", 5))
    for _ in range(4):
        assert step(plain).num_scheduled_tokens == step(hooked).num_scheduled_tokens
