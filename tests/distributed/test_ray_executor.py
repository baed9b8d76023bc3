"""The Ray executor on a real two-node Ray cluster (ray.cluster_utils.Cluster: two raylets on
this machine, one CPU each, so the two ranks of TP=2 / PP=2 land on different nodes): greedy
equal to one process, a killed actor is a clear WorkerDeadError, and a missing Ray says how to
install it. One cluster serves the whole module (Ray starts slowly).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.executor.multiproc import WorkerDeadError
from kvserve.sampling_params import SamplingParams
from tests.executor.test_multiproc import (ENGINE_KW, GREEDY, PROMPTS, _executor,
                                          assert_close_to_reference)
from tests.utils import random_prompts

RAY_KW = dict(ENGINE_KW, distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason='needs the "ray" extra (CI installs it)')
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=1, object_store_memory=80 << 20, include_dashboard=False))
    cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference(make_checkpoint):
    path = make_checkpoint("llama", num_hidden_layers=3)
    with LLM(path, **ENGINE_KW) as llm:
        return path, llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_ray_tp2_pp2_across_two_nodes_match_one_process(ray_cluster, reference, shape) -> None:
    path, ref = reference
    with LLM(path, **RAY_KW, **shape) as llm:
        executor = _executor(llm)
        assert type(executor).__name__ == "RayDistributedExecutor"
        assert len(set(executor.worker_node_ids)) == 2       # one rank per node
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_close_to_reference(ref, outs, f"ray {shape}")


@pytest.mark.timeout(240)
def test_ray_actor_killed_is_a_clear_error(ray_cluster, reference) -> None:
    path, _ = reference
    llm = LLM(path, tensor_parallel_size=2, **RAY_KW)
    try:
        executor = _executor(llm)
        victim = executor.worker_pids[1]
        long_run = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        prompts = random_prompts(8, 4, 16, vocab=1024, seed=5)
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)

        timer = threading.Timer(1.0, kill)
        timer.start()
        try:
            with pytest.raises(WorkerDeadError) as err:
                for _ in range(100):
                    llm.generate(prompts, long_run, use_tqdm=False)
        finally:
            timer.cancel()
        assert time.monotonic() - killed_at[0] < 10.0
        assert "rank 1" in str(err.value) and str(victim) in str(err.value), str(err.value)
        with pytest.raises(WorkerDeadError, match="rank 1"):
            llm.generate(prompts[:1], long_run, use_tqdm=False)
    finally:
        llm.shutdown()


def test_missing_ray_says_how_to_install(monkeypatch, tiny_llama) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)     # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "kvserve\[ray\]"'):
        LLM(tiny_llama, tensor_parallel_size=2, **RAY_KW)
