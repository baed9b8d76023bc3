"""The engine core in its own process: same outputs as in-process, utility calls, start-up
failures, death of the engine core (SIGKILL, an error inside a step), death of the frontend,
and shut-down that leaves no process and no ipc directory behind."""
from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import msgspec
import numpy as np
import psutil
import pytest
import torch
import zmq

from kvserve import LLM, EngineArgs, SamplingParams
from kvserve.core.messages import EngineCoreOutputs
from kvserve.engine.async_llm import AsyncLLM
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.mp_client import SyncMPClient
from kvserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from tests.utils import random_prompts

ENGINE_KW: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)

pytestmark = pytest.mark.timeout(120)


def child_pids() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker (a singleton the
    spawn context starts once, shared by every spawn, that exits with this process)."""
    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(p.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        pids.add(p.pid)
    return pids


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def client_of(llm: LLM) -> SyncMPClient:
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    return client


@pytest.fixture(scope="module")
def mp_llm(tiny_llama: str):
    llm = LLM(tiny_llama, multiprocessing=True, **ENGINE_KW)
    proc = client_of(llm).resources.proc
    yield llm
    llm.shutdown()
    assert proc.exitcode == 0


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


# ---------------------------------------------------------------------- outputs
def test_multiprocessing_on_and_off_same_outputs(mp_llm: LLM, tiny_llama: str) -> None:
    prompts: list[Any] = random_prompts(12, 3, 40, vocab=1024, seed=3)
    prompts += ["The quick brown fox", "Hello, my name is"]
    params = [greedy(8 + 3 * (i % 5), logprobs=3) for i in range(len(prompts))]
    inproc = LLM(tiny_llama, multiprocessing=False, **ENGINE_KW)
    try:
        ref = inproc.generate(prompts, params, use_tqdm=False)
    finally:
        inproc.shutdown()
    assert not isinstance(inproc.llm_engine.engine_core, SyncMPClient)
    out = mp_llm.generate(prompts, params, use_tqdm=False)
    assert len(out) == len(ref)
    for r, o in zip(ref, out):
        assert o.request_id == r.request_id
        ro, oo = r.outputs[0], o.outputs[0]
        assert oo.token_ids == ro.token_ids and len(oo.token_ids) > 0
        assert oo.text == ro.text
        assert oo.finish_reason == ro.finish_reason
        assert oo.logprobs is not None and ro.logprobs is not None
        for a, b in zip(oo.logprobs, ro.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_stop_string_abort_and_reuse(mp_llm: LLM) -> None:
    """Stop strings finish requests in the frontend; the core must free them (abort)."""
    first = mp_llm.generate(["Hello, my name is"], greedy(20), use_tqdm=False)[0].outputs[0]
    assert len(first.text) > 2
    stop = first.text[1:3]
    out = mp_llm.generate(["Hello, my name is"], greedy(20, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    stats = mp_llm.get_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ---------------------------------------------------------------------- serialization
class Payload(msgspec.Struct):
    big: torch.Tensor
    arr: np.ndarray
    extra: Any = None


def test_tensors_travel_as_raw_buffers() -> None:
    big = torch.randn(64, 32)
    msg = Payload(big=big, arr=np.arange(1000, dtype=np.int32),
                  extra={"bf16": torch.arange(300).to(torch.bfloat16), "small": torch.ones(3),
                         "scalar": torch.tensor(7, dtype=torch.int64), "empty": torch.empty(0, 5)})
    bufs = MsgpackEncoder().encode(msg)
    # Main buffer plus one raw buffer per large array; the main one holds no tensor data.
    assert len(bufs) == 4 and len(bufs[0]) < 300
    assert bytes(bufs[1]) == big.numpy().tobytes()
    # Through real ZMQ frames (copy=False on both ends).
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://serial-test")
    b.connect("inproc://serial-test")
    try:
        a.send_multipart(bufs, copy=False)
        frames = b.recv_multipart(copy=False)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
    got = MsgpackDecoder(Payload).decode(frames)
    assert torch.equal(got.big, big) and got.big.dtype == torch.float32
    assert np.array_equal(got.arr, msg.arr) and got.arr.dtype == np.int32
    for k, v in msg.extra.items():
        assert torch.equal(got.extra[k], v) and got.extra[k].dtype == v.dtype, k
    # Zero-copy on receipt: the tensor is a view of the received frame.
    frame_view = np.frombuffer(frames[1].buffer, dtype=np.float32)
    frame_view[0] = 123.0
    assert got.big[0, 0].item() == 123.0
    # Utility results (typed Any) carry tensors the same way.
    out = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(
        EngineCoreOutputs(utility_output=(3, None, {"t": big}))))
    assert torch.equal(out.utility_output[2]["t"], big)


# ---------------------------------------------------------------------- utilities
def test_utility_calls(mp_llm: LLM) -> None:
    client = client_of(mp_llm)
    stats = mp_llm.get_stats()
    assert stats["num_total_blocks"] == mp_llm.llm_engine.config.cache_config.num_blocks > 0
    # A shared prefix of two full blocks: the second request hits the prefix cache.
    prefix = list(range(10, 10 + 2 * 16))
    mp_llm.generate([prefix + [7]], greedy(2), use_tqdm=False)
    mp_llm.generate([prefix + [8]], greedy(2), use_tqdm=False)
    after = mp_llm.get_stats()
    assert after["prefix_cache_hits"] >= stats["prefix_cache_hits"] + 32
    assert mp_llm.reset_prefix_cache() is True
    mp_llm.generate([prefix + [9]], greedy(2), use_tqdm=False)
    assert mp_llm.get_stats()["prefix_cache_hits"] == after["prefix_cache_hits"]
    assert client.call_utility("check_health") is True
    with pytest.raises(RuntimeError, match="no_such_method"):
        client.call_utility("no_such_method")
    with pytest.raises(RuntimeError, match="private"):
        client.call_utility("_handle_client_request", "x", None)
    # The engine is still fine after failed calls.
    assert mp_llm.get_stats()["num_total_blocks"] == stats["num_total_blocks"]


def test_utility_from_another_thread_during_generate(mp_llm: LLM) -> None:
    seen: list[dict] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            seen.append(mp_llm.get_stats())

    t = threading.Thread(target=poll)
    t.start()
    try:
        out = mp_llm.generate(random_prompts(8, 5, 20, vocab=1024, seed=5),
                              greedy(40, ignore_eos=True), use_tqdm=False)
    finally:
        done.set()
        t.join(10)
    assert all(len(o.outputs[0].token_ids) == 40 for o in out)
    assert any(s["num_running_reqs"] > 0 for s in seen)


def test_idle_engine_core_uses_no_cpu(mp_llm: LLM) -> None:
    mp_llm.generate(["warm up"], greedy(4), use_tqdm=False)
    proc = psutil.Process(client_of(mp_llm).resources.proc.pid)
    time.sleep(0.5)        # let OpenMP worker threads stop spinning
    proc.cpu_percent(None)
    time.sleep(1.0)
    assert proc.cpu_percent(None) < 5.0


# ---------------------------------------------------------------------- start-up failures
@pytest.fixture
def private_tmpdir(monkeypatch: pytest.MonkeyPatch):
    """Route the clients' ipc directories here, to check that none is left behind (a short
    path: AF_UNIX paths are limited to 107 bytes)."""
    path = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_load_failure_raises_quickly(tiny_llama: str, tmp_path, private_tmpdir: str) -> None:
    bad = str(tmp_path / "bad")
    shutil.copytree(tiny_llama, bad)
    with open(os.path.join(bad, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file" * 10)
    before = child_pids()
    start = time.monotonic()
    # A malformed file is caught by the header check before loading (model/file_checks.py):
    # a ValueError naming the file, raised from the engine's start-up as itself.
    with pytest.raises(ValueError) as info:
        LLM(bad, multiprocessing=True, **ENGINE_KW)
    assert time.monotonic() - start < 60
    msg = str(info.value)
    assert "Engine core initialization failed" in msg and "corrupt or truncated" in msg
    assert "Traceback" in msg and "load" in msg      # the engine's own traceback
    assert child_pids() <= before
    assert os.listdir(private_tmpdir) == []


def test_kv_cache_too_small_keeps_value_error(tiny_llama: str, private_tmpdir: str) -> None:
    before = child_pids()
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, multiprocessing=True, dtype="float32", max_model_len=256,
            num_gpu_blocks_override=2)
    assert child_pids() <= before
    assert os.listdir(private_tmpdir) == []


# ---------------------------------------------------------------------- engine core death
def test_sigkill_engine_core_llm(tiny_llama: str) -> None:
    before = child_pids()
    with LLM(tiny_llama, multiprocessing=True, **ENGINE_KW) as llm:
        client = client_of(llm)
        pid, ipc_dir = client.resources.proc.pid, client.resources.ipc_dir
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                llm.generate(random_prompts(16, 5, 20, vocab=1024, seed=7),
                             greedy(200, ignore_eos=True), use_tqdm=False)
            except BaseException as e:
                result["error"], result["at"] = e, time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        # Kill it mid-generation: once requests are running.
        deadline = time.monotonic() + 30
        while llm.get_stats()["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        assert isinstance(result.get("error"), EngineDeadError), result
        assert result["at"] - killed_at < 5.0
        assert "died unexpectedly" in str(result["error"])
        with pytest.raises(EngineDeadError):
            llm.generate(["again"], greedy(2), use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.get_stats()
    assert child_pids() <= before
    assert not os.path.exists(ipc_dir)


def test_error_inside_step_reports_engine_dead(tiny_llama: str) -> None:
    """An exception in a step is not swallowed: the engine sends its traceback and exits."""
    # CPU: on CUDA the bad id is a device-side assert that poisons the whole CUDA context.
    llm = LLM(tiny_llama, multiprocessing=True, **{**ENGINE_KW, "device": "cpu"})
    try:
        engine = llm.llm_engine
        proc = client_of(llm).resources.proc
        params = greedy(4)
        request, _ = engine.process_inputs("bad", [5, 6, 7], params)
        # Past the input processor's validation: the model's embedding lookup fails.
        request.prompt_token_ids = [5, 10**6]
        engine.add_processed_request(request, None, params)
        with pytest.raises(EngineDeadError) as info:
            while engine.has_unfinished_requests():
                engine.step()
        assert "IndexError" in str(info.value) and "embedding" in str(info.value)
        # Usually exits in ~0.5 s; a watchdog hard-exits it 5 s after the error at the latest.
        # The client's monitor thread reaps the process too: while it holds the status,
        # our own join() can return with exitcode still None, so poll until it is set.
        deadline = time.monotonic() + 20
        while proc.exitcode is None and time.monotonic() < deadline:
            proc.join(0.1)
        assert proc.exitcode == 1
    finally:
        llm.shutdown()


def test_sigkill_engine_core_async_streams(tiny_llama: str) -> None:
    before = child_pids()
    loop = asyncio.new_event_loop()
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, **ENGINE_KW))
    pid = engine.engine_core.resources.proc.pid
    started: list[int] = []

    async def stream(i: int) -> Optional[BaseException]:
        try:
            async for _ in engine.generate(f"stream {i}", greedy(200, ignore_eos=True), f"s{i}"):
                if i not in started:
                    started.append(i)
        except BaseException as e:
            return e
        return None

    async def main() -> list[Optional[BaseException]]:
        tasks = [asyncio.create_task(stream(i)) for i in range(4)]
        while len(started) < 4:
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    try:
        errors = loop.run_until_complete(main())
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            loop.run_until_complete(engine.check_health())

        async def again() -> None:
            async for _ in engine.generate("again", greedy(2), "again"):
                pass
        with pytest.raises(EngineDeadError):
            loop.run_until_complete(again())
    finally:
        engine.shutdown()
        loop.close()
    assert child_pids() <= before


# ---------------------------------------------------------------------- shut-down
def test_del_leaves_nothing(tiny_llama: str) -> None:
    before = child_pids()
    llm = LLM(tiny_llama, multiprocessing=True, **ENGINE_KW)
    resources = client_of(llm).resources      # holds no reference to the client
    pid, ipc_dir = resources.proc.pid, resources.ipc_dir
    assert llm.generate(["bye"], greedy(3), use_tqdm=False)[0].outputs[0].token_ids
    assert os.path.isdir(ipc_dir)
    del llm
    gc.collect()
    assert wait_gone(pid)
    assert resources.closed
    assert resources.proc.exitcode == 0       # a clean exit on SIGTERM, not a SIGKILL
    assert child_pids() <= before
    assert not os.path.exists(ipc_dir)


_SCRIPT = """
import os, signal, sys
from kvserve import LLM
llm = LLM({model!r}, multiprocessing=True, dtype="float32", max_model_len=256,
          kv_cache_memory=16 << 20)
client = llm.llm_engine.engine_core
print(client.resources.proc.pid, client.resources.ipc_dir, flush=True)
llm.generate(["hi"], use_tqdm=False)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
# "exit": leave without shutdown(); the exit hooks must end the engine core.
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_frontend_exit_or_death_ends_engine_core(tiny_llama: str, how: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(model=tiny_llama), how],
                          capture_output=True, text=True, timeout=90,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    lines = proc.stdout.split()
    assert len(lines) >= 2, proc.stderr[-3000:]
    pid, ipc_dir = int(lines[0]), lines[1]
    try:
        if how == "exit":
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert not psutil.pid_exists(pid) or wait_gone(pid, 1.0)
            assert not os.path.exists(ipc_dir)
        else:
            assert proc.returncode == -signal.SIGKILL
            # The orphaned engine core sees its parent gone and exits by itself.
            assert wait_gone(pid, 15.0)
    finally:
        if psutil.pid_exists(pid) and not wait_gone(pid, 0.1):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ipc_dir, ignore_errors=True)
