"""Pipeline parallelism: the layer split, greedy equality with one process (PP=2 with an uneven
split, TP=2 x PP=2), the batch queue (several batches in flight, in-flight requests never
scheduled twice), and a killed stage.

The engine core runs in this process (multiprocessing=False) so that the workers are this
process's children and the leak checks of tests/executor see them.
"""
from __future__ import annotations

import pytest

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.core.request import Request
from kvserve.core.scheduler import Scheduler
from kvserve.distributed.pp_utils import PP_LAYER_PARTITION_ENV, get_pp_indices, get_pp_partition
from kvserve.entrypoints.llm import LLM
from kvserve.sampling_params import SamplingParams
from tests.executor.test_multiproc import (ENGINE_KW, GREEDY, PROMPTS, LeakWatch, _executor,
                                          assert_close_to_reference, generate_until_killed)


@pytest.fixture(scope="module")
def llama3(make_checkpoint) -> str:
    """Three layers: PP=2 splits them unevenly (2 + 1)."""
    return make_checkpoint("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def reference(llama3: str):
    with LLM(llama3, **ENGINE_KW) as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


# ---- the layer split ------------------------------------------------------------------------

def test_layer_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    assert get_pp_partition(4, 2) == [2, 2]
    assert get_pp_partition(3, 2) == [2, 1]          # the remainder goes before the last stage
    assert get_pp_partition(7, 3) == [2, 3, 2]
    assert get_pp_partition(8, 3) == [3, 3, 2]
    assert [get_pp_indices(7, r, 3) for r in range(3)] == [(0, 2), (2, 5), (5, 7)]
    with pytest.raises(ValueError, match="cannot be split"):
        get_pp_partition(2, 3)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,3")
    assert get_pp_partition(4, 2) == [1, 3]
    for bad in ("2,3", "4,0", "1,1,2", "a,b"):
        monkeypatch.setenv(PP_LAYER_PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=PP_LAYER_PARTITION_ENV):
            get_pp_partition(4, 2)


def test_unsplittable_layer_count_fails_before_any_process(tiny_llama: str) -> None:
    watch = LeakWatch()
    with pytest.raises(ValueError, match="2 layers, which cannot be split"):
        LLM(tiny_llama, pipeline_parallel_size=3, **ENGINE_KW)
    with pytest.raises(ValueError, match="needs 'mp' or 'ray'"):
        LLM(tiny_llama, pipeline_parallel_size=2, distributed_executor_backend="uni", **ENGINE_KW)
    assert not watch.new_children()


# ---- the batch queue's scheduling rule --------------------------------------------------------

def _request(rid: str, n: int) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(5, 5 + n)),
                   sampling_params=SamplingParams(max_tokens=4), eos_token_ids=set(),
                   arrival_time=0.0)


def test_scheduler_never_schedules_an_in_flight_request() -> None:
    cache = CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=64), cache,
                      send_sampled_tokens=True)
    for i in range(3):
        sched.add_request(_request(f"r{i}", 6))
    first = sched.schedule()                 # r0 (6 tokens) + 2 tokens of r1
    second = sched.schedule()                # r2 only: r0 and r1 are in flight
    assert set(first.num_scheduled_tokens) == {"r0", "r1"}
    assert set(second.num_scheduled_tokens) == {"r2"}
    assert sched.schedule().is_empty         # everything is in flight
    from kvserve.core.sched_output import ModelRunnerOutput
    sched.update_from_output(first, ModelRunnerOutput(req_ids=["r0", "r1"],
                                                      sampled_token_ids=[[7], []]))
    third = sched.schedule()                 # r0 decodes, r1 continues its prefill
    assert third.num_scheduled_tokens == {"r0": 1, "r1": 4}
    # PP: every stage learns r0's sampled token from the scheduler.
    cached = third.scheduled_cached_reqs
    assert cached.new_token_ids[cached.req_ids.index("r0")] == [7]
    assert cached.new_token_ids[cached.req_ids.index("r1")] == []


# ---- end to end -------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_pp2_uneven_split_matches_one_process(llama3: str, reference) -> None:
    watch = LeakWatch()
    with LLM(llama3, pipeline_parallel_size=2, **ENGINE_KW) as llm:
        watch.workers(expected=2)
        assert _executor(llm).output_rank == 1
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_close_to_reference(reference, outs, "pp2")
        # A small token budget splits the requests over several batches, so the batch
        # queue keeps two in flight (one per stage); the tokens must not change.
        engine = llm.llm_engine.engine_core.engine_core
        engine.scheduler.config.max_num_batched_tokens = 8
        in_flight: list[int] = []
        step = engine.step_with_batch_queue

        def counting_step():
            in_flight.append(len(engine.batch_queue))
            return step()

        engine.step_with_batch_queue = counting_step
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert max(in_flight) == 2
        assert_close_to_reference(reference, outs, "pp2 batch queue")
    watch.assert_clean()


@pytest.mark.timeout(240)
def test_tp2_pp2_and_partition_env(llama3: str, reference, monkeypatch) -> None:
    """4 processes (2 stages x 2 TP ranks) with the split given as 1 + 2 layers."""
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,2")
    watch = LeakWatch()
    with LLM(llama3, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE_KW) as llm:
        watch.workers(expected=4)
        assert _executor(llm).output_rank == 2     # first TP rank of the last stage
        layers = _executor(llm).collective_rpc("get_num_local_layers")
        assert layers == [1, 1, 2, 2]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_close_to_reference(reference, outs, "tp2 x pp2")
    watch.assert_clean()


@pytest.mark.timeout(240)
def test_killed_stage_fails_fast_and_cleans_up(llama3: str) -> None:
    watch = LeakWatch()
    llm = LLM(llama3, pipeline_parallel_size=2, **ENGINE_KW)
    try:
        victim = watch.workers(expected=2)[0]      # the first stage: it never answers
        error, raised_after = generate_until_killed(llm, victim.pid, 0.5)
        assert raised_after < 5.0
        assert "rank 0" in str(error) and "SIGKILL" in str(error)
        watch.wait_no_children(timeout=5.0)
    finally:
        llm.shutdown()
    watch.assert_clean()
