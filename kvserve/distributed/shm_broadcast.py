"""One writer, N readers: a message queue over a shared-memory ring buffer.

The engine core broadcasts each ``collective_rpc`` to every worker through one
``MessageQueue`` (``rpc_broadcast_mq``), and each worker answers through its own
(``worker_response_mq``, one reader). Objects are pickled with protocol 5; large
contiguous buffers (numpy arrays, CPU tensors) travel out of band as raw bytes.

Segment layout (C = max_chunks, R = number of local readers)::

    ┌─────────┬─────────┬─────┬───────────┬──────────────────────────────────────┐
    │ chunk 0 │ chunk 1 │ ... │ chunk C-1 │ flags: C × [w | r0 | r1 | .. | rR-1] │
    └─────────┴─────────┴─────┴───────────┴──────────────────────────────────────┘
      max_chunk_bytes each                  one byte each, never in a chunk

One chunk::

    ┌──────┬───────────┬──────────┬─────────────┬──────────┬────────────┬─────┐
    │ [0]  │ [1:3]     │ [3:7]    │ [7:7+L0]    │ 4 bytes  │ L1 bytes   │ ... │
    │ over │ n buffers │ L0 (u32) │ main pickle │ L1 (u32) │ oob buf 1  │     │
    └──────┴───────────┴──────────┴─────────────┴──────────┴────────────┴─────┘
    over = 1: the message did not fit; its frames follow on the ZMQ PUB socket
    and only this byte of the chunk is meaningful.

Flag states of one chunk (w = written, r_i = read by local reader i)::

    w=0  r=? ... ?   never written, or being (re)written: readers wait, writer owns it
    w=1  r=0 ... 0   published: every reader may read it
    w=1  r=1 0 1 ?   partly read: readers with r_i = 1 have moved to the next chunk
    w=1  r=1 ... 1   read by all: the writer may reuse it

Writer: wait until w=0 or all r_i=1; set w=0; write the payload; fence; reset
all r_i to 0; fence; set w=1 (last). Reader: wait until w=1 and r_me=0; fence;
read the payload; fence; set r_me=1. Writer and readers walk the chunks in the
same order, so each reader sees every message once and in order, and the writer
blocks when the slowest reader is C messages behind. The order of the writer's
flag stores matters: a reader may read a stale w=1 from the chunk's previous
round and then a fresh r_me=0; that is still safe because the r flags are
reset only after the payload is complete, and w=1 is the very last store.

Memory ordering. Python has no fence primitive. What this relies on: (1) the
payload and the flags are separate bytes written by separate stores (memcpy for
the payload, a one-byte store per flag), so a flag store never tears the
payload; (2) ``memory_fence()`` acquires and releases a lock, i.e. atomic
read-modify-write instructions, a full barrier on x86 and, through glibc's mutex,
in practice on AArch64 (vLLM relies on the same); (3) on x86 (TSO) stores are
seen in program order anyway, so "payload, then flag" is enough there.

Readers poll; ``SpinTimer`` turns the poll into spin, then ``sched_yield``, then
sleep, so an idle engine does not burn a core. The writer waits the same way
when the ring is full. A message larger than a chunk, and every message to
readers on other nodes ("remote" readers, ZMQ only), goes over a ZMQ XPUB
socket; XPUB lets the writer see each reader's subscription, which is the
ready handshake (``wait_until_ready``).
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import struct
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Optional

import zmq

logger = logging.getLogger(__name__)

# Buffers at least this large go out of band (one memcpy into the chunk instead
# of two); smaller ones stay inside the main pickle as raw bytes.
OOB_MIN_BYTES = 1 << 16
_HEADER = 3                 # over flag (1 byte) + buffer count (u16)
_LEN = struct.Struct("<I")  # length prefix of each buffer
_READY = b"READY"
_WARN_EVERY_S = 60.0

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """Full memory barrier (see the module docstring): a lock round trip."""
    _fence_lock.acquire()
    _fence_lock.release()


class MessageQueueCancelled(RuntimeError):
    """A blocking enqueue/dequeue was given up because its ``cancel`` event was set."""


class SpinTimer:
    """Backoff for a poll loop: spin, then yield the CPU, then sleep.

    For ``spin_s`` after ``start()`` each ``wait()`` returns at once; until
    ``yield_s`` it calls ``sched_yield`` (other runnable threads on this core go
    first; it also releases the GIL); after that it sleeps for ``sleep_fraction``
    of the time waited so far, at most ``max_sleep_s``. The sleep therefore adds
    at most ``sleep_fraction`` to a long wait, and an idle poller wakes
    ``1 / max_sleep_s`` times a second.

    ``spin_s`` defaults to 0: when writer and reader share a core (more
    processes than cores), every microsecond one of them spins delays the
    other; measured on 2 busy cores, a 50 us spin made the round trip 4x slower
    (benchmarks/ipc.py). With an idle core to spare, a yield costs ~1 us.
    """

    def __init__(self, spin_s: float = 0.0, yield_s: float = 2e-3,
                 sleep_fraction: float = 0.02, max_sleep_s: float = 0.05) -> None:
        self.spin_s = spin_s
        self.yield_s = yield_s
        self.sleep_fraction = sleep_fraction
        self.max_sleep_s = max_sleep_s
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Back off once; False when ``timeout`` (seconds since start) has passed."""
        elapsed = time.perf_counter() - self._t0
        if timeout is not None and elapsed >= timeout:
            return False
        if elapsed < self.spin_s:
            return True
        if elapsed < self.yield_s:
            os.sched_yield()
            return True
        sleep = min(self.max_sleep_s, max(elapsed * self.sleep_fraction, 1e-5))
        if timeout is not None:
            sleep = min(sleep, timeout - elapsed)
        time.sleep(sleep)
        return True


def _attach_untracked(name: str) -> SharedMemory:
    """Attach to a segment without letting this process's resource tracker own it.

    Before Python 3.13 attaching registers the name with the resource tracker,
    which unlinks the segment when this (reader) process exits, under the
    writer's feet. Only the creating writer should own it.
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register  # type: ignore[assignment]


def _unlink_segment(shm: SharedMemory) -> None:
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def _remove_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmRingBuffer:
    """The shared-memory segment: ``max_chunks`` data chunks, then the flag bytes."""

    def __init__(self, n_reader: int, max_chunk_bytes: int, max_chunks: int,
                 name: Optional[str] = None) -> None:
        self.n_reader = n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.flag_bytes = 1 + n_reader
        data_bytes = max_chunk_bytes * max_chunks
        self.is_creator = name is None
        if self.is_creator:
            # Unique per instance: two engines on one machine never collide.
            name = f"kvserve_mq_{os.getpid()}_{uuid.uuid4().hex[:12]}"
            self.shm = SharedMemory(name=name, create=True,
                                    size=data_bytes + max_chunks * self.flag_bytes)
            # Unlinks the segment if the writer is garbage-collected or the
            # interpreter exits without close(); a no-op after close().
            self._finalizer = weakref.finalize(self, _unlink_segment, self.shm)
        else:
            self.shm = _attach_untracked(name)
        self.name = name
        buf = self.shm.buf
        self.chunks = [buf[i * max_chunk_bytes:(i + 1) * max_chunk_bytes]
                       for i in range(max_chunks)]
        self.flags = [buf[data_bytes + i * self.flag_bytes:data_bytes + (i + 1) * self.flag_bytes]
                      for i in range(max_chunks)]

    def _release_views(self) -> None:
        for view in self.chunks + self.flags:
            view.release()
        self.chunks, self.flags = [], []

    def __del__(self) -> None:
        # Views first, or SharedMemory.__del__ fails on "exported pointers exist".
        self._release_views()

    def close(self) -> None:
        self._release_views()
        try:
            self.shm.close()
        except BufferError:
            # A stray view (e.g. held by a traceback) still pins the mapping;
            # it goes with the process. The name is unlinked below all the same.
            pass
        if self.is_creator:
            self._finalizer()


@dataclass
class Handle:
    """What a reader process needs to attach (picklable; msgspec can encode it)."""

    n_reader: int
    local_reader_ranks: list[int] = field(default_factory=list)
    shm_name: Optional[str] = None
    max_chunk_bytes: int = 0
    max_chunks: int = 0
    local_subscribe_addr: Optional[str] = None
    remote_subscribe_addr: Optional[str] = None


class _Pickler(pickle.Pickler):
    """Protocol-5 pickler that sends plain CPU tensors as raw out-of-band buffers.

    torch's own pickling copies a tensor's storage into a bytes object via
    ``torch.save``; here its bytes become a ``PickleBuffer`` like a numpy array's.
    Tensor subclasses and non-CPU tensors keep torch's pickling.
    """

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")  # no tensor can exist if torch is not loaded
        if (torch is None or type(obj) is not torch.Tensor or obj.device.type != "cpu"
                or obj.layout != torch.strided):
            return NotImplemented
        t = obj.detach().resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return _rebuild_tensor, (pickle.PickleBuffer(raw), t.dtype, tuple(t.shape))


def _rebuild_tensor(data: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    import torch
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    if not isinstance(data, bytearray):  # a read-only buffer: own a writable copy
        data = bytearray(data)
    return torch.frombuffer(data, dtype=dtype).reshape(shape)


def serialize(obj: Any, oob_min_bytes: int = OOB_MIN_BYTES) -> list[Any]:
    """Frames of ``obj``: the main pickle, then its out-of-band buffers (bytes-like)."""
    frames: list[Any] = [b""]

    def buffer_callback(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < oob_min_bytes:
            return True  # in band
        frames.append(raw)
        return False

    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffer_callback).dump(obj)
    frames[0] = out.getbuffer()
    return frames


def deserialize(frames: list[Any]) -> Any:
    # Out-of-band buffers are copied into memory the result owns: the chunk they
    # sit in is reused once the read flag is set, and ZMQ frames are read-only.
    return pickle.loads(frames[0], buffers=[bytearray(f) for f in frames[1:]])


def _recv_frames(sock: zmq.Socket, timeout: Optional[float]) -> list[Any]:
    if timeout is not None and not sock.poll(max(0, int(timeout * 1000))):
        raise TimeoutError("MessageQueue: timed out waiting for a ZMQ frame")
    return sock.recv_multipart(copy=False)


class MessageQueue:
    """Broadcast queue: the creating process writes, ``n_reader`` processes read.

    Readers with rank in ``local_reader_ranks`` (default the first
    ``n_local_reader`` ranks) read the shared-memory ring; the others get every
    message over TCP. Both sides call ``wait_until_ready()`` before the first
    message; the writer calls ``close()`` to unlink the segment.
    """

    def __init__(self, n_reader: int, n_local_reader: int,
                 local_reader_ranks: Optional[list[int]] = None,
                 max_chunk_bytes: int = 10 * 1024 * 1024, max_chunks: int = 10,
                 connect_ip: str = "127.0.0.1",
                 spin_timer: Optional[SpinTimer] = None) -> None:
        if not 0 <= n_local_reader <= n_reader:
            raise ValueError(f"need 0 <= n_local_reader ({n_local_reader}) <= n_reader ({n_reader})")
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if len(local_reader_ranks) != n_local_reader or not set(local_reader_ranks) <= set(range(n_reader)):
            raise ValueError(f"bad local_reader_ranks {local_reader_ranks}")
        self._init_common(spin_timer)
        self._is_writer = True
        self.n_reader, self.n_local_reader = n_reader, n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        local_addr = remote_addr = None
        if n_local_reader > 0:
            self.buffer = ShmRingBuffer(n_local_reader, max_chunk_bytes, max_chunks)
            self._all_read = b"\x01" * n_local_reader
            self._none_read = b"\x00" * n_local_reader
            self._ipc_path = os.path.join(tempfile.gettempdir(), f"kvserve-mq-{uuid.uuid4().hex}.ipc")
            local_addr = f"ipc://{self._ipc_path}"
            self.local_socket = self._xpub(local_addr)
            self._ipc_finalizer = weakref.finalize(self, _remove_file, self._ipc_path)
        if self.n_remote_reader > 0:
            host = f"[{connect_ip}]" if ":" in connect_ip else connect_ip
            self.remote_socket = self._xpub(f"tcp://{host}:*")  # port 0: the OS picks
            remote_addr = self.remote_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.handle = Handle(n_reader=n_reader, local_reader_ranks=list(local_reader_ranks),
                             shm_name=self.buffer.name if self.buffer else None,
                             max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks,
                             local_subscribe_addr=local_addr, remote_subscribe_addr=remote_addr)

    def _init_common(self, spin_timer: Optional[SpinTimer]) -> None:
        self._ctx = zmq.Context()
        self._timer = spin_timer or SpinTimer()
        self.buffer: Optional[ShmRingBuffer] = None
        self.local_socket: Optional[zmq.Socket] = None
        self.remote_socket: Optional[zmq.Socket] = None
        self._ipc_path: Optional[str] = None
        self._idx = 0  # next chunk to write / read
        self._ready = self._closed = False

    def _xpub(self, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass every subscription up: the handshake counts them
        sock.setsockopt(zmq.SNDHWM, 0)        # PUB drops at the high-water mark; never drop
        if addr.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(addr)
        return sock

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int,
                           spin_timer: Optional[SpinTimer] = None) -> "MessageQueue":
        """The reader side for reader ``rank`` (0 <= rank < handle.n_reader)."""
        if not 0 <= rank < handle.n_reader:
            raise ValueError(f"reader rank {rank} not in [0, {handle.n_reader})")
        self = cls.__new__(cls)
        self._init_common(spin_timer)
        self._is_writer = False
        self.n_reader = handle.n_reader
        self.n_local_reader = len(handle.local_reader_ranks)
        self.n_remote_reader = self.n_reader - self.n_local_reader
        self.handle = handle
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        if rank in handle.local_reader_ranks:
            assert handle.shm_name is not None and handle.local_subscribe_addr is not None
            self._local_idx = handle.local_reader_ranks.index(rank)
            self.buffer = ShmRingBuffer(self.n_local_reader, handle.max_chunk_bytes,
                                        handle.max_chunks, name=handle.shm_name)
            self.local_socket = sock
            addr = handle.local_subscribe_addr
        else:
            assert handle.remote_subscribe_addr is not None
            self.remote_socket = sock
            addr = handle.remote_subscribe_addr
            if addr.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
        sock.connect(addr)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return self

    def export_handle(self) -> Handle:
        return self.handle

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Writer: wait until every reader has subscribed, then send READY. Reader: wait for READY."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def poll(sock: zmq.Socket) -> None:
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(left):
                raise TimeoutError("MessageQueue.wait_until_ready timed out")

        if self._is_writer:
            for sock, n in ((self.local_socket, self.n_local_reader),
                            (self.remote_socket, self.n_remote_reader)):
                if sock is None:
                    continue
                subscribed = 0
                while subscribed < n:
                    poll(sock)
                    if sock.recv()[:1] == b"\x01":  # \x01 subscribe, \x00 unsubscribe
                        subscribed += 1
                sock.send(_READY)
        else:
            sock = self.local_socket if self.local_socket is not None else self.remote_socket
            poll(sock)
            msg = sock.recv()
            if msg != _READY:
                raise RuntimeError(f"MessageQueue: expected READY, got {msg[:32]!r}")
        self._ready = True

    # ---- ring buffer protocol -------------------------------------------------

    def _backoff(self, timeout: Optional[float], cancel: Optional[threading.Event], what: str) -> None:
        if cancel is not None and cancel.is_set():
            raise MessageQueueCancelled(f"MessageQueue.{what} cancelled")
        if not self._timer.wait(timeout):
            raise TimeoutError(f"MessageQueue.{what} timed out after {timeout} s")
        if self._is_writer and self._timer.elapsed() > self._next_warn:
            self._next_warn += _WARN_EVERY_S
            logger.warning("MessageQueue: no free chunk for %.0f s; a reader is stuck or slow",
                           self._timer.elapsed())

    def _acquire_write(self, timeout: Optional[float], cancel: Optional[threading.Event]) -> memoryview:
        flags = self.buffer.flags[self._idx]
        self._timer.start()
        self._next_warn = _WARN_EVERY_S
        while True:
            snap = flags.tobytes()
            if snap[0] == 0 or snap[1:] == self._all_read:
                break
            self._backoff(timeout, cancel, "enqueue")
        memory_fence()  # the flags are read before the payload is overwritten
        flags[0] = 0
        return self.buffer.chunks[self._idx]

    def _publish(self) -> None:
        flags = self.buffer.flags[self._idx]
        memory_fence()                 # payload before the read flags ...
        flags[1:] = self._none_read
        memory_fence()                 # ... read flags before the written flag
        flags[0] = 1
        memory_fence()
        self._idx = (self._idx + 1) % self.buffer.max_chunks

    def _acquire_read(self, timeout: Optional[float], cancel: Optional[threading.Event]) -> memoryview:
        flags = self.buffer.flags[self._idx]
        me = 1 + self._local_idx
        self._timer.start()
        while not (flags[0] == 1 and flags[me] == 0):
            self._backoff(timeout, cancel, "dequeue")
        memory_fence()  # the flags are read before the payload
        return self.buffer.chunks[self._idx]

    def _release_read(self) -> None:
        memory_fence()  # the payload is read before the writer may reuse the chunk
        self.buffer.flags[self._idx][1 + self._local_idx] = 1
        memory_fence()
        self._idx = (self._idx + 1) % self.buffer.max_chunks

    # ---- public API -------------------------------------------------------------

    def enqueue(self, obj: Any, timeout: Optional[float] = None,
                cancel: Optional[threading.Event] = None) -> None:
        """Send ``obj`` to every reader; blocks while the slowest local reader is a ring behind."""
        if not self._is_writer or self._closed:
            raise RuntimeError("enqueue needs an open writer (the creating process)")
        if not self._ready:
            raise RuntimeError("call wait_until_ready() before enqueue(): PUB drops frames to late subscribers")
        frames = serialize(obj)
        if self.buffer is not None:
            total = _HEADER + sum(_LEN.size + len(f) for f in frames)
            overflow = total > self.buffer.max_chunk_bytes or len(frames) > 0xFFFF
            chunk = self._acquire_write(timeout, cancel)
            if overflow:
                chunk[0] = 1
            else:
                chunk[0] = 0
                chunk[1:3] = len(frames).to_bytes(2, "little")
                off = _HEADER
                for f in frames:
                    n = len(f)
                    _LEN.pack_into(chunk, off, n)
                    chunk[off + _LEN.size:off + _LEN.size + n] = f
                    off += _LEN.size + n
            self._publish()
            if overflow:
                self.local_socket.send_multipart(frames)  # copies: the caller may mutate obj
        if self.remote_socket is not None:
            self.remote_socket.send_multipart(frames)

    def dequeue(self, timeout: Optional[float] = None,
                cancel: Optional[threading.Event] = None) -> Any:
        """Next message; raises TimeoutError after ``timeout`` seconds without one.

        ``cancel`` is checked while waiting on the ring (local readers); a remote
        reader only honours ``timeout``.
        """
        if self._is_writer or self._closed:
            raise RuntimeError("dequeue needs an open reader (create_from_handle)")
        start = time.monotonic()
        if self.buffer is None:  # remote reader
            return deserialize(_recv_frames(self.remote_socket, timeout))
        chunk = self._acquire_read(timeout, cancel)
        try:
            overflow = chunk[0] == 1
            if not overflow:
                count = int.from_bytes(chunk[1:3], "little")
                frames, off = [], _HEADER
                for _ in range(count):
                    (n,) = _LEN.unpack_from(chunk, off)
                    off += _LEN.size
                    frames.append(chunk[off:off + n])
                    off += n
                obj = deserialize(frames)
                del frames
        finally:
            del chunk
            self._release_read()  # even if unpickling failed: never stall the writer
        if overflow:
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            obj = deserialize(_recv_frames(self.local_socket, left))
        return obj

    def close(self) -> None:
        """Close sockets and the mapping; the writer also unlinks the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for sock in (self.local_socket, self.remote_socket):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        if self.buffer is not None:
            self.buffer.close()
        if self._ipc_path is not None:
            self._ipc_finalizer()  # libzmq removes the file on close; make sure

    def __enter__(self) -> "MessageQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
