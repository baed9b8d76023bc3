"""The Ray executor on a real two-node Ray cluster (ray.cluster_utils.Cluster: two raylets on
this machine, one CPU each, so the two ranks of TP=2 / PP=2 land on different nodes): greedy
equal to one process, a killed actor is a clear WorkerDeadError, and a missing Ray says how to
install it. One cluster serves the whole module (Ray starts slowly).
"""
from __future__ import annotations

import sys

import pytest

from kvserve.entrypoints.llm import LLM
from kvserve.executor.multiproc import WorkerDeadError
from tests.executor.test_multiproc import (ENGINE_KW, GREEDY, LONG_PROMPTS, LONG_RUN, PROMPTS,
                                          _executor, assert_close_to_reference,
                                          generate_until_killed)

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
        error, raised_after = generate_until_killed(llm, victim, 1.0)
        assert raised_after < 10.0
        assert "rank 1" in str(error) and str(victim) in str(error), str(error)
        with pytest.raises(WorkerDeadError, match="rank 1"):
            llm.generate(LONG_PROMPTS[:1], LONG_RUN, use_tqdm=False)
    finally:
        llm.shutdown()


def test_missing_ray_says_how_to_install(monkeypatch, tiny_llama) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)     # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r'pip install "kvserve\[ray\]"'):
        LLM(tiny_llama, tensor_parallel_size=2, **RAY_KW)
