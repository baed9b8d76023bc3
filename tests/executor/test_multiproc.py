"""MultiprocExecutor and tensor parallelism end to end, through `LLM`.

Every test that starts workers checks afterwards that no child process (other than
multiprocessing's resource tracker) and no shared-memory segment created by this process or
its workers is left. The engine core runs in this process (multiprocessing=False) so that
what is tested is the executor, wherever the engine core may run by default.
"""
from __future__ import annotations

import gc
import os
import shutil
import signal
import threading
import time
from typing import Callable

import psutil
import pytest
import torch

from kvserve.entrypoints.llm import LLM
from kvserve.executor.multiproc import (MultiprocExecutor, WorkerDeadError, WorkerRPCError,
                                       _unlink_leftovers)
from kvserve.executor.uniproc import UniProcExecutor
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from tests.utils import check_greedy_close, random_prompts

# TP on CPU (gloo): pinned, so that a GPU box runs these as here.
ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
                 multiprocessing=False, device="cpu")
PROMPTS = random_prompts(4, 3, 12, vocab=1024, seed=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
TP_LOGPROB_ATOL = 1e-3
SHM_DIR = "/dev/shm"


# ---- leak checks ----------------------------------------------------------------------------

def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker
    return getattr(resource_tracker._resource_tracker, "_pid", None)


def _children() -> list[psutil.Process]:
    tracker = _resource_tracker_pid()
    return [p for p in psutil.Process().children(recursive=True) if p.pid != tracker]


def _shm_entries() -> set[str]:
    return set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()


class LeakWatch:
    """Snapshot before; `workers()` while the engine lives; `assert_clean()` at the end.

    Segments are named kvserve_mq_<creator pid>_<uuid>: only those created by this process
    or by the workers seen here count (other engineers' tests run beside these)."""

    def __init__(self) -> None:
        self.children_before = {p.pid for p in _children()}
        self.shm_before = _shm_entries()
        self.pids = {os.getpid()}

    def new_children(self) -> list[psutil.Process]:
        return [p for p in _children() if p.pid not in self.children_before]

    def workers(self, expected: int) -> list[psutil.Process]:
        procs = self.new_children()
        self.pids |= {p.pid for p in procs}
        assert sorted(p.name() for p in procs) == [f"KVSWorker_TP{r}" for r in range(expected)]
        return sorted(procs, key=lambda p: p.name())

    def wait_no_children(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (left := self.new_children()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"

    def assert_clean(self, timeout: float = 10.0) -> None:
        self.wait_no_children(timeout)
        leaked = [name for name in _shm_entries() - self.shm_before
                  if name.startswith("kvserve_mq_") and int(name.split("_")[2]) in self.pids]
        assert not leaked, f"shared-memory segments left behind: {leaked}"


def _executor(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor


# ---- references and comparison -------------------------------------------------------------

@pytest.fixture(scope="module")
def uniproc_outputs() -> Callable[[str], list[RequestOutput]]:
    """TP=1, in-process worker: the reference, computed once per model."""
    cache: dict[str, list[RequestOutput]] = {}

    def get(path: str) -> list[RequestOutput]:
        if path not in cache:
            with LLM(path, **ENGINE_KW) as llm:
                assert isinstance(_executor(llm), UniProcExecutor)
                cache[path] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        return cache[path]

    return get


def _dense(logprobs: dict, vocab: int) -> torch.Tensor:
    """The top-k dict of one position as a full row (-inf elsewhere), for check_greedy_close."""
    row = torch.full((vocab,), float("-inf"))
    row[list(logprobs)] = torch.tensor([lp.logprob for lp in logprobs.values()])
    return row


def assert_close_to_reference(ref: list[RequestOutput], outs: list[RequestOutput], what: str,
                              atol: float = TP_LOGPROB_ATOL) -> None:
    assert len(outs) == len(ref)
    for i, (r, o) in enumerate(zip(ref, outs)):
        ref_tokens, ref_lps = r.outputs[0].token_ids, r.outputs[0].logprobs
        assert len(ref_tokens) == GREEDY.max_tokens
        # Same greedy tokens, or a near-tie at the first difference (each side's token in the
        # other's top-5), as tests/utils.py defines it.
        n = check_greedy_close(ref_tokens, [_dense(d, 1024) for d in ref_lps], o,
                               name=f"{what} prompt {i}")
        for pos in range(n):
            tok = ref_tokens[pos]
            got, want = o.outputs[0].logprobs[pos][tok].logprob, ref_lps[pos][tok].logprob
            assert abs(got - want) < atol, f"{what} prompt {i} pos {pos}: {got} vs {want}"


# ---- tensor parallelism ---------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_tp2_llama_matches_tp1_and_rpc_semantics(tiny_llama: str, uniproc_outputs) -> None:
    """TP=2 == TP=1 for Llama; collective_rpc's reply rules; context-manager shut-down."""
    ref = uniproc_outputs(tiny_llama)
    watch = LeakWatch()
    with LLM(tiny_llama, tensor_parallel_size=2, **ENGINE_KW) as llm:
        workers = watch.workers(expected=2)
        ex = _executor(llm)
        assert isinstance(ex, MultiprocExecutor)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_close_to_reference(ref, outs, "tp2 llama")

        # Every rank answers, in rank order; or only the one asked for.
        assert ex.collective_rpc("check_health") == [True, True]
        assert ex.collective_rpc("check_health", unique_reply_rank=1) == [True]
        blocks = ex.collective_rpc("determine_num_kv_blocks")
        assert len(blocks) == 2 and blocks[0] == blocks[1] > 0
        # Non-blocking calls: the replies are read in call order, whichever is waited on first.
        f1 = ex.collective_rpc("determine_num_kv_blocks", non_block=True)
        f2 = ex.collective_rpc("check_health", unique_reply_rank=0, non_block=True)
        assert f2.result() == [True] and f1.done() and f1.result() == blocks
        f3 = ex.collective_rpc("check_health", non_block=True)
        assert ex.collective_rpc("determine_num_kv_blocks", unique_reply_rank=1) == [blocks[1]]
        assert f3.result() == [True, True]
        # A method that raises: every rank's reply is consumed, the error names the rank and
        # carries the worker's traceback, and the executor keeps working.
        with pytest.raises(WorkerRPCError,
                           match=r"(?s)rank 0 failed in 'no_such_method'.*AttributeError"):
            ex.collective_rpc("no_such_method")
        # A call that times out: its late replies are skipped, not taken for the next call's.
        with pytest.raises(TimeoutError, match="check_health"):
            ex.collective_rpc("check_health", timeout=0)
        assert ex.collective_rpc("determine_num_kv_blocks") == blocks
        with pytest.raises(ValueError, match="unique_reply_rank"):
            ex.collective_rpc("check_health", unique_reply_rank=2)
        # The engine is unaffected by all of that.
        again = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:2]]
        assert all(w.is_running() for w in workers)
    watch.assert_clean()


@pytest.mark.timeout(90)
def test_tp2_qwen3_matches_tp1_and_del_cleans_up(tiny_qwen3: str, uniproc_outputs) -> None:
    """TP=2 == TP=1 for Qwen3 (explicit head_dim, q/k norms); `del llm` + gc shuts down."""
    ref = uniproc_outputs(tiny_qwen3)
    watch = LeakWatch()
    llm = LLM(tiny_qwen3, tensor_parallel_size=2, **ENGINE_KW)
    watch.workers(expected=2)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    watch.assert_clean()
    assert_close_to_reference(ref, outs, "tp2 qwen3")


@pytest.mark.timeout(60)
def test_mp_backend_tp1_equals_uniproc_and_shutdown(tiny_llama: str, uniproc_outputs) -> None:
    ref = uniproc_outputs(tiny_llama)
    watch = LeakWatch()
    llm = LLM(tiny_llama, distributed_executor_backend="mp", **ENGINE_KW)
    watch.workers(expected=1)
    assert isinstance(_executor(llm), MultiprocExecutor)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.shutdown()
    watch.assert_clean()
    llm.shutdown()   # idempotent
    # The same computation in another process: same tokens, logprobs to rounding.
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert_close_to_reference(ref, outs, "mp tp1", atol=1e-5)
    with pytest.raises(WorkerDeadError, match="shut down"):
        _executor(llm).collective_rpc("check_health")


# ---- failures -------------------------------------------------------------------------------

# A long greedy generation, still running when a worker is killed.
LONG_RUN = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
LONG_PROMPTS = random_prompts(8, 4, 16, vocab=1024, seed=5)


def generate_until_killed(llm: LLM, pid: int, delay: float) -> tuple[WorkerDeadError, float]:
    """SIGKILL `pid` `delay` seconds into long generations; returns the WorkerDeadError that
    generate raised and how many seconds after the kill it came. (The loop only guards
    against a machine fast enough to finish a whole batch before the timer fires.)"""
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(delay, kill)
    timer.start()
    try:
        with pytest.raises(WorkerDeadError) as err:
            for _ in range(100):
                llm.generate(LONG_PROMPTS, LONG_RUN, use_tqdm=False)
    finally:
        timer.cancel()
    return err.value, time.monotonic() - killed_at[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim_rank", [1, 0])   # a silent rank; the answering rank
def test_worker_killed_mid_generation(tiny_llama: str, victim_rank: int) -> None:
    watch = LeakWatch()
    llm = LLM(tiny_llama, tensor_parallel_size=2, **ENGINE_KW)
    try:
        victim = watch.workers(expected=2)[victim_rank]
        error, raised_after = generate_until_killed(llm, victim.pid, 0.5)
        assert raised_after < 5.0, f"the error took {raised_after:.1f} s"
        msg = str(error)
        assert f"rank {victim_rank}" in msg and "SIGKILL" in msg and str(victim.pid) in msg, msg
        # The monitor ended the surviving rank on its own, before any shut-down call.
        watch.wait_no_children(timeout=5.0)
        # Later calls fail at once with the same reason.
        start = time.monotonic()
        with pytest.raises(WorkerDeadError, match=f"rank {victim_rank}"):
            llm.generate(LONG_PROMPTS[:1], LONG_RUN, use_tqdm=False)
        assert time.monotonic() - start < 1.0
    finally:
        llm.shutdown()
    watch.assert_clean()


def _executor_owner(path: str, conn) -> None:
    """A process that owns an executor, reports its workers' pids, then waits to be killed."""
    from kvserve.engine.arg_utils import EngineArgs
    config = EngineArgs.from_kwargs(model=path, distributed_executor_backend="mp",
                                    **ENGINE_KW).create_engine_config()
    executor = MultiprocExecutor(config)
    conn.send(([w.proc.pid for w in executor._resources.workers],
               executor._resources.rpc_broadcast_mq.export_handle()))
    time.sleep(600)


@pytest.mark.timeout(60)
def test_workers_exit_when_their_parent_dies(tiny_llama: str) -> None:
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    owner = ctx.Process(target=_executor_owner, args=(tiny_llama, child_conn))
    owner.start()
    broadcast_handle = None
    try:
        assert parent_conn.poll(45), "the executor did not start"
        pids, broadcast_handle = parent_conn.recv()
        workers = [psutil.Process(pid) for pid in pids]
        assert [w.name() for w in workers] == ["KVSWorker_TP0"]
        owner.kill()
        owner.join()
        # Re-parented to init; each notices within about a second of idling.
        gone, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, f"orphaned workers still running: {alive}"
        # An orphan cleans up its own response segment.
        assert not [n for n in _shm_entries() if n.startswith(f"kvserve_mq_{workers[0].pid}_")]
    finally:
        # The owner was killed here on purpose: remove its broadcast segment and socket file.
        if broadcast_handle is not None:
            _unlink_leftovers(broadcast_handle)
        if owner.is_alive():
            owner.kill()
            owner.join()
        for w in psutil.Process().children(recursive=True):
            if w.pid != _resource_tracker_pid():
                w.kill()
    assert not [n for n in _shm_entries() if n.startswith(f"kvserve_mq_{owner.pid}_")]


@pytest.mark.timeout(30)
def test_indivisible_head_count_fails_before_any_process(tiny_llama: str) -> None:
    watch = LeakWatch()
    with pytest.raises(ValueError, match=r"attention heads \(4\) must be divisible by "
                                         r"tensor_parallel_size \(3\)"):
        LLM(tiny_llama, tensor_parallel_size=3, **ENGINE_KW)
    assert not watch.new_children()
    watch.assert_clean(timeout=0)


@pytest.mark.timeout(30)
def test_more_cuda_ranks_than_gpus_fails_before_any_process(tiny_llama: str) -> None:
    """TP ranks beyond the visible GPUs: a clear error naming both numbers, before any worker
    process starts (on a CPU box none are visible; on a GPU box, one more than there are)."""
    visible = torch.cuda.device_count()
    tp = visible + 1 if visible + 1 in (1, 2, 4) else 2   # heads (4) must divide by tp
    if tp <= visible:
        pytest.skip(f"{visible} GPUs visible: cannot ask for more with 4 heads")
    watch = LeakWatch()
    with pytest.raises(ValueError, match=rf"{tp} ranks need {tp} GPUs, but only {visible} "
                                         rf"visible"):
        LLM(tiny_llama, tensor_parallel_size=tp, **{**ENGINE_KW, "device": "cuda"})
    assert not watch.new_children()
    watch.assert_clean(timeout=0)


@pytest.mark.timeout(60)
def test_worker_start_up_failure_reports_traceback(tiny_llama: str, tmp_path) -> None:
    """Weights that cannot be read: the workers' own traceback comes back, nothing is left."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    watch = LeakWatch()
    with pytest.raises(RuntimeError, match=r"(?s)Worker of rank \d failed during start-up:.*"
                                           r"Traceback.*load_model"):
        LLM(str(bad), tensor_parallel_size=2, **ENGINE_KW)
    watch.assert_clean()
