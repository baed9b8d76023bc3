"""MessageQueue over the shared-memory ring buffer, with real reader processes.

Each reader process regenerates the expected message sequence itself and checks
what it dequeued against it (order, values, dtypes), so a lost, duplicated,
reordered or corrupted message fails the test.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvserve.distributed.shm_broadcast import (Handle, MessageQueue, MessageQueueCancelled,
                                               SpinTimer, serialize)

CTX = mp.get_context("spawn")


# ---- expected messages (regenerated in each reader process) -----------------------

def _messages(kind: str) -> list[Any]:
    rng = np.random.default_rng(0)
    if kind == "mixed":  # many more messages than chunks, sizes from 1 B to ~20 KiB
        return [{"step": i, "req_ids": [f"req-{j}" for j in range(i % 7)],
                 "payload": rng.bytes(int(rng.integers(0, 20_000)))} for i in range(400)]
    if kind == "overflow":  # chunk is 4 KiB: every other message goes over ZMQ
        return [(i, rng.bytes(6000 if i % 3 == 0 else 100), rng.standard_normal(i % 4 * 10))
                for i in range(60)]
    if kind == "tensors":
        import torch
        g = torch.Generator().manual_seed(0)
        return [
            torch.randn(1024, 1024, generator=g),                           # 4 MiB, out of band
            np.arange(2_000_000, dtype=np.int64),                           # 16 MB > chunk: overflow
            {"logits": torch.randn(64, 4096, generator=g).to(torch.bfloat16),
             "ids": torch.randint(0, 32000, (64,), generator=g),
             "mask": torch.rand(300, 300, generator=g) > 0.5},
            torch.randn(512, 512, generator=g).t(),                         # non-contiguous
            np.random.default_rng(1).standard_normal((700, 300)).astype(np.float16),
            torch.zeros(0, 5), torch.tensor(3.5),                           # empty, 0-dim
            # Overwrite both chunks: a result still aliasing the ring would change.
            np.full(1_000_000, 7, dtype=np.int32), np.full(1_000_000, 9, dtype=np.int32),
        ]
    if kind == "slow":
        return [("msg", i, list(range(i % 50))) for i in range(100)]
    raise ValueError(kind)


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if type(a).__name__ == "Tensor":
        import torch
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _reader_main(handle: Handle, rank: int, kind: str, result_q: Any, delay_s: float = 0.0) -> None:
    mq = MessageQueue.create_from_handle(handle, rank)
    try:
        mq.wait_until_ready(timeout=30)
        expected = _messages(kind)
        # Collect everything before comparing: a result that still pointed into a
        # chunk would have been overwritten by later messages by then.
        got = []
        for _ in expected:
            got.append(mq.dequeue(timeout=15))
            if delay_s:
                time.sleep(delay_s)
        bad = [i for i, (e, g) in enumerate(zip(expected, got)) if not _equal(e, g)]
        for g in got:  # results own writable memory
            if isinstance(g, np.ndarray) and g.size:
                assert g.flags.writeable
        result_q.put((rank, len(got), bad[:5]))
    except BaseException as e:  # report instead of dying silently
        result_q.put((rank, -1, repr(e)))
    finally:
        mq.close()


@contextmanager
def _reader_procs(handle: Handle, ranks: list[int], kind: str,
                  delays: dict[int, float] | None = None) -> Iterator[Any]:
    result_q = CTX.Queue()
    procs = [CTX.Process(target=_reader_main, daemon=True,
                         args=(handle, r, kind, result_q, (delays or {}).get(r, 0.0)))
             for r in ranks]
    for p in procs:
        p.start()
    try:
        yield result_q
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _check_results(result_q: Any, ranks: list[int], n: int) -> None:
    results = sorted(result_q.get(timeout=60) for _ in ranks)
    assert results == [(r, n, []) for r in sorted(ranks)], results


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}") if os.path.isdir("/dev/shm") else False


# ---- process tests -----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_several_readers_wrap_around_and_a_remote_reader() -> None:
    # 3 readers: ranks 0 and 1 read shared memory, rank 2 is "remote" (TCP only).
    mq = MessageQueue(3, 2, max_chunk_bytes=32 * 1024, max_chunks=4)
    msgs = _messages("mixed")
    try:
        with _reader_procs(mq.export_handle(), [0, 1, 2], "mixed") as result_q:
            mq.wait_until_ready(timeout=30)
            for m in msgs:
                mq.enqueue(m, timeout=30)
            _check_results(result_q, [0, 1, 2], len(msgs))
    finally:
        mq.close()


@pytest.mark.timeout(60)
def test_overflow_goes_over_zmq_in_order() -> None:
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    msgs = _messages("overflow")
    try:
        sizes = [sum(len(f) for f in serialize(m)) for m in msgs]
        assert sum(s > 4096 for s in sizes) == 20 and sum(s < 4000 for s in sizes) == 40
        with _reader_procs(mq.export_handle(), [0], "overflow") as result_q:
            mq.wait_until_ready(timeout=30)
            for m in msgs:
                mq.enqueue(m, timeout=30)
            _check_results(result_q, [0], len(msgs))
    finally:
        mq.close()


@pytest.mark.timeout(60)
def test_large_tensors_and_arrays_out_of_band() -> None:
    msgs = _messages("tensors")
    frames = serialize(msgs[0])  # a 4 MiB tensor is one raw out-of-band frame
    assert len(frames) == 2 and len(frames[1]) == 4 * 1024 * 1024 and len(frames[0]) < 1024
    mq = MessageQueue(2, 2, max_chunk_bytes=8 * 1024 * 1024, max_chunks=2)
    try:
        with _reader_procs(mq.export_handle(), [0, 1], "tensors") as result_q:
            mq.wait_until_ready(timeout=30)
            for m in msgs:
                mq.enqueue(m, timeout=30)
            _check_results(result_q, [0, 1], len(msgs))
    finally:
        mq.close()


@pytest.mark.timeout(60)
def test_slow_reader_blocks_the_writer_and_loses_nothing() -> None:
    delay, max_chunks = 0.005, 2
    mq = MessageQueue(2, 2, max_chunk_bytes=4096, max_chunks=max_chunks)
    msgs = _messages("slow")
    try:
        with _reader_procs(mq.export_handle(), [0, 1], "slow", delays={1: delay}) as result_q:
            mq.wait_until_ready(timeout=30)
            t0 = time.perf_counter()
            for m in msgs:
                mq.enqueue(m, timeout=30)
            elapsed = time.perf_counter() - t0
            _check_results(result_q, [0, 1], len(msgs))
        # The writer can be at most max_chunks messages ahead of the slow reader.
        assert elapsed >= 0.8 * delay * (len(msgs) - max_chunks - 1), elapsed
    finally:
        mq.close()


@pytest.mark.timeout(60)
def test_close_leaves_no_shared_memory_behind() -> None:
    mq = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    name, ipc = mq.buffer.name, mq.handle.local_subscribe_addr[len("ipc://"):]
    assert _shm_exists(name) and os.path.exists(ipc)
    with _reader_procs(mq.export_handle(), [0], "slow") as result_q:
        mq.wait_until_ready(timeout=30)
        for m in _messages("slow"):
            mq.enqueue(m, timeout=30)
        _check_results(result_q, [0], 100)
    # The reader attached and exited: the segment must survive it (the reader's
    # resource tracker must not unlink what the writer owns) ...
    assert _shm_exists(name)
    mq.close()
    mq.close()  # idempotent
    assert not _shm_exists(name) and not os.path.exists(ipc)
    # ... and a writer dropped without close() still unlinks on collection.
    mq2 = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2)
    name2 = mq2.buffer.name
    assert name2 != name and mq2.handle.local_subscribe_addr != mq.handle.local_subscribe_addr
    del mq2
    gc.collect()
    assert not _shm_exists(name2)


# ---- in-process tests ----------------------------------------------------------------

@contextmanager
def _pair(n_reader: int = 1, **kw: Any) -> Iterator[tuple[MessageQueue, list[MessageQueue]]]:
    timer = SpinTimer(spin_s=0.0)  # threads share the GIL: never spin without yielding
    mq = MessageQueue(n_reader, n_reader, spin_timer=timer, **kw)
    readers = [MessageQueue.create_from_handle(mq.export_handle(), r, spin_timer=SpinTimer(spin_s=0.0))
               for r in range(n_reader)]
    threads = [threading.Thread(target=r.wait_until_ready, args=(10,)) for r in readers]
    for t in threads:
        t.start()
    mq.wait_until_ready(timeout=10)
    for t in threads:
        t.join()
    try:
        yield mq, readers
    finally:
        for r in readers:
            r.close()
        mq.close()


@pytest.mark.timeout(30)
def test_dequeue_and_enqueue_time_out() -> None:
    with _pair(max_chunk_bytes=1024, max_chunks=2) as (mq, (reader,)):
        t0, cpu0 = time.perf_counter(), time.thread_time()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=1.0)
        # An idle reader backs off to sleeping: it must not burn a core while waiting.
        assert 1.0 <= time.perf_counter() - t0 < 3.0
        assert time.thread_time() - cpu0 < 0.15
        mq.enqueue("a")
        mq.enqueue("b")
        with pytest.raises(TimeoutError):  # the ring is full: nobody has read
            mq.enqueue("c", timeout=0.2)
        assert reader.dequeue(timeout=1) == "a"
        mq.enqueue("c", timeout=1)
        assert [reader.dequeue(timeout=1) for _ in range(2)] == ["b", "c"]
        cancel = threading.Event()
        threading.Timer(0.1, cancel.set).start()
        with pytest.raises(MessageQueueCancelled):
            reader.dequeue(cancel=cancel)


def test_handle_round_trips_and_writer_checks() -> None:
    mq = MessageQueue(3, 2, max_chunk_bytes=1024, max_chunks=3)
    try:
        h = mq.export_handle()
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=Handle) == h
        assert pickle.loads(pickle.dumps(h)) == h
        assert h.local_reader_ranks == [0, 1] and h.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
        with pytest.raises(RuntimeError, match="wait_until_ready"):
            mq.enqueue(1)
        with pytest.raises(ValueError):
            MessageQueue.create_from_handle(h, 3)
    finally:
        mq.close()
    with pytest.raises(ValueError):
        MessageQueue(1, 2)


_message = st.one_of(
    st.integers(), st.text(max_size=20), st.binary(max_size=3000),
    st.lists(st.integers(0, 2**31), max_size=64),
    st.integers(0, 400).map(lambda n: np.arange(n, dtype=np.float32)),
)


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None)
@given(msgs=st.lists(_message, max_size=30), n_reader=st.integers(1, 3),
       max_chunks=st.integers(1, 4), max_chunk_bytes=st.sampled_from([256, 1024, 4096]))
def test_each_reader_sees_every_message_once_in_order(msgs: list[Any], n_reader: int,
                                                      max_chunks: int, max_chunk_bytes: int) -> None:
    seen: list[list[Any]] = [[] for _ in range(n_reader)]
    with _pair(n_reader, max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks) as (mq, readers):
        def read(i: int) -> None:
            for _ in msgs:
                seen[i].append(readers[i].dequeue(timeout=10))
        threads = [threading.Thread(target=read, args=(i,)) for i in range(n_reader)]
        for t in threads:
            t.start()
        for m in msgs:
            mq.enqueue(m, timeout=10)
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads)
        with pytest.raises(TimeoutError):  # nothing extra
            readers[0].dequeue(timeout=0.01)
    for s in seen:
        assert _equal(s, msgs)
