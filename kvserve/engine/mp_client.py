"""Clients for an engine core running in its own process (EngineCoreProc), over ZMQ.

    MPClient           spawns the engine core process, binds the sockets, runs the start-up
                       handshake, watches the process; owns BackgroundResources.
    SyncMPClient       for LLM / LLMEngine: a thread reads the output socket into a queue.
    AsyncMPClient      for AsyncLLM: an asyncio task reads the output socket into a queue.

Every client instance binds its sockets as `ipc://` paths in a fresh temporary directory, so
two engines on one machine never collide. Everything the client must release lives in
BackgroundResources, which holds no reference to the client: the client can be garbage
collected (`del llm`), and a finalizer plus one atexit hook still end the engine process and
remove the directory. The atexit hook is registered after multiprocessing's own (which joins
non-daemon children), so it runs first and the interpreter never waits on a live engine.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  (its atexit hook must be registered before ours)
import os
import queue
import shutil
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Optional, Union

import zmq
import zmq.asyncio

from kvserve.config import KVServeConfig
from kvserve.core.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from kvserve.engine.core_client import EngineCoreClient
from kvserve.engine.core_proc import ENGINE_CORE_DEAD, dp_handshake_timeout_s, engine_identity
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.launch import (ClientAddresses, client_addresses,
                                   launch_core_engines, make_engine_addresses,
                                   recv_during_startup)
from kvserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 5.0
# Blocking waits in the caller's thread wake up this often: a signal (Ctrl-C) that the kernel
# handed to another thread only runs its Python handler once the main thread runs again.
_WAIT_SLICE_S = 0.5
# AF_UNIX paths are limited to 107 bytes.
_MAX_IPC_PATH = 100

_ACTIVE: set["BackgroundResources"] = set()


def _close_all_at_exit() -> None:
    for resources in list(_ACTIVE):
        resources.close()


atexit.register(_close_all_at_exit)


class BackgroundResources:
    """What an MPClient must release, and its shared death / utility-call state."""

    def __init__(self) -> None:
        self.ctx: Optional[zmq.Context] = None
        self.sockets: list[zmq.Socket] = []
        self.proc: Optional[multiprocessing.process.BaseProcess] = None   # our first engine
        # Our engine processes by DP rank (none in an API server of several, and only this
        # node's with multi-node data parallelism).
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        self.num_engines = 1
        self.coordinator: Any = None           # DPCoordinator (data parallelism)
        self.dp_store: Any = None              # the DP group's rendezvous TCPStore
        # Data parallelism: engines that died while others live on, and what to do then.
        self.dead_engines: set[int] = set()
        self.on_engine_dead: Optional[Callable[[int, str], None]] = None
        self.ipc_dir: Optional[str] = None
        self.threads: list[threading.Thread] = []
        # Readable once close() starts: wakes the monitor and the sync output reader.
        self.wake_r, self.wake_w = os.pipe()
        self.lock = threading.Lock()
        self.closed = False
        self.engine_dead = False
        self._dead_message = ""
        self._dead_traceback: Optional[str] = None
        # Set by the client: delivers the death to its waiters (output queue, utility calls).
        self.on_dead: Optional[Callable[[], None]] = None
        self.outputs_queue: Union[queue.Queue, asyncio.Queue, None] = None
        self.utility_futures: dict[int, Any] = {}
        self.loop: Optional[asyncio.AbstractEventLoop] = None      # AsyncMPClient's loop
        self.output_task: Optional[asyncio.Task] = None
        _ACTIVE.add(self)

    # ------------------------------------------------------------------ death
    def make_dead_error(self) -> EngineDeadError:
        if self.closed and not self.engine_dead:
            return EngineDeadError("The engine core has been shut down.")
        return EngineDeadError(self._dead_message or None, self._dead_traceback)

    def mark_dead(self, message: str, engine_traceback: Optional[str] = None) -> None:
        with self.lock:
            if self.engine_dead or self.closed:
                return
            self.engine_dead = True
            self._dead_message, self._dead_traceback = message, engine_traceback
        logger.error("%s", message)
        if self.on_dead is not None:
            self.on_dead()

    # ------------------------------------------------------------------ release
    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        _ACTIVE.discard(self)
        try:
            os.write(self.wake_w, b"x")
            for proc in self.procs.values():
                _stop_process(proc)
            if self.coordinator is not None:
                self.coordinator.shutdown()
            current = threading.current_thread()
            for t in self.threads:
                if t is not current:
                    t.join(timeout=_SHUTDOWN_GRACE_S)
            # Wake whoever still waits for an output or a utility result ("shut down").
            if self.on_dead is not None and self.outputs_queue is not None:
                self.on_dead()
            self._stop_output_task()
            for sock in self.sockets:
                sock.close(linger=0)
            if self.ctx is not None:
                self.ctx.term()
        finally:
            # Whatever failed above, no directory and no descriptors are left behind.
            os.close(self.wake_r)
            os.close(self.wake_w)
            if self.ipc_dir is not None:
                shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _stop_output_task(self) -> None:
        if self.output_task is not None:
            cancel_task(self.output_task)


def cancel_task(task: asyncio.Task) -> None:
    """Cancel `task` from its loop's thread, another thread, or while its loop is idle."""
    loop = task.get_loop()
    if loop.is_closed() or task.done():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        task.cancel()
    elif loop.is_running():
        loop.call_soon_threadsafe(task.cancel)
    elif running is None:
        # The loop is idle (e.g. shut down between run_until_complete calls): let the task
        # see its cancellation now rather than be destroyed pending later.
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    else:
        task.cancel()


def _stop_process(proc: multiprocessing.process.BaseProcess) -> None:
    """SIGTERM (the engine shuts down cleanly), then SIGKILL if it does not exit in time."""
    if proc.is_alive():
        proc.terminate()
        proc.join(_SHUTDOWN_GRACE_S)
    if proc.is_alive():
        logger.warning("Engine core process %s did not exit on SIGTERM; killing it.", proc.pid)
        proc.kill()
        proc.join(_SHUTDOWN_GRACE_S)


def _make_ipc_dir() -> str:
    path = tempfile.mkdtemp(prefix="kvserve-ipc-")
    if len(path) + 16 > _MAX_IPC_PATH:      # a long TMPDIR: fall back to /tmp
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="kvserve-ipc-", dir="/tmp")
    return path


def _is_dead_message(frames: list[Any]) -> bool:
    first = frames[0]
    return len(first) == len(ENGINE_CORE_DEAD) and bytes(first.buffer) == ENGINE_CORE_DEAD


def _dead_traceback(frames: list[Any]) -> Optional[str]:
    return bytes(frames[1].buffer).decode(errors="replace") if len(frames) > 1 else None


def _engine_died(resources: BackgroundResources, engine_index: int, message: str) -> None:
    """One engine is gone: with data parallelism its requests fail and the others keep
    serving; otherwise (or when it was the last) the whole client is dead."""
    with resources.lock:
        resources.dead_engines.add(engine_index)
        survivors = resources.num_engines - len(resources.dead_engines)
    if survivors > 0 and resources.on_engine_dead is not None:
        logger.error("%s The other %d engine(s) keep serving.", message, survivors)
        resources.on_engine_dead(engine_index, message)
        return
    resources.mark_dead(message)


def _monitor_engine(resources: BackgroundResources, proc_sentinel: int, pid: int,
                    engine_index: int = 0) -> None:
    """Thread: notices one of our engine core processes dying, whatever killed it."""
    multiprocessing.connection.wait([proc_sentinel, resources.wake_r])
    if resources.closed:
        return
    proc = resources.procs.get(engine_index)
    exitcode = None
    if proc is not None:
        proc.join(1.0)      # the sentinel fires as the process exits, a moment before it is reaped
        exitcode = proc.exitcode
    name = (f"Engine core process {engine_index}" if resources.num_engines > 1
            else "Engine core process")
    _engine_died(resources, engine_index,
                 f"{name} (pid {pid}) died unexpectedly (exit code {exitcode}).")


def _monitor_connections(resources: BackgroundResources, monitor: zmq.Socket,
                         fd_engine: dict[int, int]) -> None:
    """Thread: engines that are not our child processes (another node's, or started by the
    API-server launcher) are watched through their connection to our input socket: a process
    that exits closes it, and ZMTP heartbeats close it for a host that vanished."""
    from zmq.utils.monitor import recv_monitor_message
    poller = zmq.Poller()
    poller.register(monitor, zmq.POLLIN)
    poller.register(resources.wake_r, zmq.POLLIN)
    try:
        while fd_engine:
            events = dict(poller.poll())
            if resources.closed or monitor not in events:
                return
            event = recv_monitor_message(monitor)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            engine_index = fd_engine.pop(int(event["value"]), None)
            if engine_index is not None:
                _engine_died(resources, engine_index,
                             f"Engine core {engine_index} ({event['endpoint'].decode()}) "
                             f"disconnected: its process died or its node is unreachable.")
    except zmq.ZMQError:
        return       # closed with the client


class MPClient(EngineCoreClient):
    """Base of the multiprocess clients: start-up, sending, shut-down."""

    def __init__(self, config: KVServeConfig, asyncio_mode: bool,
                 addresses: Optional[ClientAddresses] = None) -> None:
        """`addresses`: one of several API servers, whose engines someone else started."""
        self.config = config
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.resources = r = BackgroundResources()
        self._finalizer = weakref.finalize(self, r.close)
        self._finalizer.atexit = False        # _close_all_at_exit does it, and earlier
        self.num_engines = r.num_engines = config.parallel_config.data_parallel_size
        self.engine_identities = [engine_identity(i) for i in range(self.num_engines)]
        self.engine_identity = self.engine_identities[0]
        self._call_ids = itertools.count()
        self._fd_engine: dict[int, int] = {}
        try:
            r.ipc_dir = _make_ipc_dir()
            r.ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
            sync_ctx = zmq.Context.shadow(r.ctx.underlying) if asyncio_mode else r.ctx
            engine_addresses = None
            if addresses is None:
                engine_addresses = make_engine_addresses(config.parallel_config, r.ipc_dir)
                addresses = client_addresses(engine_addresses, 0)
            self.addresses = addresses
            self.input_socket = r.ctx.socket(zmq.ROUTER)
            self.output_socket = r.ctx.socket(zmq.PULL)
            r.sockets += [self.input_socket, self.output_socket]
            input_sync = (zmq.Socket.shadow(self.input_socket.underlying) if asyncio_mode
                          else self.input_socket)
            # A vanished remote host is noticed (its connection closed) within seconds.
            input_sync.setsockopt(zmq.HEARTBEAT_IVL, 2_000)
            input_sync.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
            self.input_socket.bind(addresses.input)
            self.output_socket.bind(addresses.output)
            monitor_address = f"inproc://kvserve-input-monitor-{id(r)}"
            input_sync.monitor(monitor_address, zmq.EVENT_DISCONNECTED)
            self._monitor_socket = sync_ctx.socket(zmq.PAIR)
            self._monitor_socket.connect(monitor_address)
            r.sockets.append(self._monitor_socket)
            if engine_addresses is not None:
                launch_core_engines(config, r, engine_addresses, sync_ctx)
            self._fd_engine = self._wait_for_registration(input_sync)
        except BaseException:
            r.close()
            raise

    def _wait_for_registration(self, input_sync: zmq.Socket) -> dict[int, int]:
        """The engines' input DEALERs register themselves (until then the ROUTER would drop
        messages addressed to them). Returns, for the engines that are not our child
        processes, their connection's file descriptor -> engine index."""
        r = self.resources
        registered: dict[int, int] = {}
        deadline = time.monotonic() + dp_handshake_timeout_s()
        while len(registered) < self.num_engines:
            frames = recv_during_startup(input_sync, list(r.procs.values()), deadline,
                                         "the engines' input connections", copy=False)
            identity = bytes(frames[0].buffer)
            if identity not in self.engine_identities:
                raise RuntimeError(f"Unexpected engine identity {identity!r} on the input socket.")
            # ZMQ_SRCFD: the connection this message came on (deprecated, still in libzmq 4.3).
            registered[int.from_bytes(identity, "little")] = frames[0].get(zmq.SRCFD)
        return {fd: index for index, fd in registered.items() if index not in r.procs}

    def _start_monitor(self) -> None:
        r = self.resources
        for index, proc in r.procs.items():
            t = threading.Thread(target=_monitor_engine,
                                 args=(r, proc.sentinel, proc.pid, index),
                                 daemon=True, name=f"EngineCoreMonitor_{index}")
            t.start()
            r.threads.append(t)
        if self._fd_engine:
            t = threading.Thread(target=_monitor_connections,
                                 args=(r, self._monitor_socket, self._fd_engine),
                                 daemon=True, name="EngineConnectionMonitor")
            t.start()
            r.threads.append(t)

    # ------------------------------------------------------------------ common
    def _ensure_alive(self) -> None:
        r = self.resources
        if r.engine_dead or r.closed:
            raise r.make_dead_error()

    def _frames(self, request_type: EngineCoreRequestType, obj: Any,
                identity: Optional[bytes] = None) -> list[Any]:
        return [identity or self.engine_identity, request_type.value, *self.encoder.encode(obj)]

    @property
    def is_dead(self) -> bool:
        return self.resources.engine_dead

    def shutdown(self) -> None:
        self._finalizer()

    @staticmethod
    def _utility_result(call_id_failure_result: list[Any]) -> tuple[int, Optional[str], Any]:
        call_id, failure, result = call_id_failure_result
        return int(call_id), failure, result


# ---------------------------------------------------------------------- sync
def _sync_output_reader(r: BackgroundResources, sock: zmq.Socket,
                        decoder: MsgpackDecoder) -> None:
    """Thread: output socket -> outputs_queue; utility results -> their futures."""
    assert isinstance(r.outputs_queue, queue.Queue)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(r.wake_r, zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll())
            if sock not in events or r.closed:
                return
            frames = sock.recv_multipart(copy=False)
            if not _dispatch_output(r, frames, decoder):
                return
    except Exception as e:
        if not r.closed:
            logger.exception("Engine core output reader failed.")
            r.mark_dead(f"Reading the engine core's outputs failed: {type(e).__name__}: {e}")


def _dispatch_output(r: BackgroundResources, frames: list, decoder: MsgpackDecoder) -> bool:
    """One message from the output socket (either reader): a utility result to its future,
    step outputs to outputs_queue. False when the engine announced its death."""
    if _is_dead_message(frames):
        r.mark_dead("The engine core failed.", _dead_traceback(frames))
        return False
    outputs: EngineCoreOutputs = decoder.decode(frames)
    if outputs.utility_output is None:
        r.outputs_queue.put_nowait(outputs)
        return True
    call_id, failure, result = MPClient._utility_result(outputs.utility_output)
    fut = r.utility_futures.pop(call_id, None)
    if fut is not None and not fut.done():
        if failure is not None:
            fut.set_exception(RuntimeError(failure))
        else:
            fut.set_result(result)
    return True


def _sync_on_dead(r: BackgroundResources) -> None:
    assert isinstance(r.outputs_queue, queue.Queue)
    r.outputs_queue.put_nowait(r.make_dead_error())
    for call_id in list(r.utility_futures):
        fut = r.utility_futures.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(r.make_dead_error())


class SyncMPClient(MPClient):
    """The engine core client of LLM / LLMEngine when multiprocessing is on."""

    def __init__(self, config: KVServeConfig) -> None:
        super().__init__(config, asyncio_mode=False)
        r = self.resources
        try:
            r.outputs_queue = queue.Queue()
            r.on_dead = functools.partial(_sync_on_dead, r)
            # The input socket is shared by the caller's threads (e.g. a stats thread).
            self._send_lock = threading.Lock()
            reader = threading.Thread(target=_sync_output_reader,
                                      args=(r, self.output_socket, self.decoder),
                                      daemon=True, name="EngineCoreOutputReader")
            reader.start()
            r.threads.append(reader)
            self._start_monitor()
        except BaseException:
            r.close()
            raise

    def _send(self, request_type: EngineCoreRequestType, obj: Any) -> None:
        self._ensure_alive()
        with self._send_lock:
            frames = self._frames(request_type, obj)
            self.input_socket.send_multipart(frames, copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        # Nothing to abort in a dead engine: no error, so callers can clean up freely.
        if request_ids and not (self.resources.engine_dead or self.resources.closed):
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        outputs_queue = self.resources.outputs_queue
        assert isinstance(outputs_queue, queue.Queue)
        while True:
            self._ensure_alive()
            try:
                out = outputs_queue.get(timeout=_WAIT_SLICE_S)
            except queue.Empty:
                continue
            if isinstance(out, BaseException):
                raise out
            return out

    def call_utility(self, method: str, *args: Any) -> Any:
        r = self.resources
        call_id = next(self._call_ids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        r.utility_futures[call_id] = fut
        try:
            self._send(EngineCoreRequestType.UTILITY, (call_id, method, args))
        except BaseException:
            r.utility_futures.pop(call_id, None)
            raise
        if r.engine_dead and not fut.done():     # died between registering and sending
            fut.set_exception(r.make_dead_error())
        while True:
            try:
                return fut.result(timeout=_WAIT_SLICE_S)
            except concurrent.futures.TimeoutError:
                continue

    # The async variants (so both clients serve the same callers); blocking parts in a thread.
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        return await asyncio.get_running_loop().run_in_executor(None, self.get_output)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.call_utility, method, *args))


# ---------------------------------------------------------------------- async
async def _async_output_reader(r: BackgroundResources, sock: zmq.asyncio.Socket,
                               decoder: MsgpackDecoder) -> None:
    """Task: output socket -> outputs_queue; utility results -> their futures."""
    assert isinstance(r.outputs_queue, asyncio.Queue)
    try:
        while True:
            frames = await sock.recv_multipart(copy=False)
            if not _dispatch_output(r, frames, decoder):
                return
    except asyncio.CancelledError:
        raise
    except Exception as e:
        if not r.closed:
            logger.exception("Engine core output reader failed.")
            r.mark_dead(f"Reading the engine core's outputs failed: {type(e).__name__}: {e}")


def _async_on_dead(r: BackgroundResources) -> None:
    """Runs in any thread; the queue and futures belong to the loop, so hop onto it."""
    loop = r.loop
    if loop is None or loop.is_closed():
        return      # not bound to a loop yet: _ensure_output_task sees engine_dead

    def deliver() -> None:
        assert isinstance(r.outputs_queue, asyncio.Queue)
        r.outputs_queue.put_nowait(r.make_dead_error())
        for call_id in list(r.utility_futures):
            fut = r.utility_futures.pop(call_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(r.make_dead_error())

    try:
        if asyncio.get_running_loop() is loop:
            deliver()
            return
    except RuntimeError:
        pass
    try:
        loop.call_soon_threadsafe(deliver)
    except RuntimeError:      # the loop was closed meanwhile
        pass


class AsyncMPClient(MPClient):
    """The engine core client of AsyncLLM. Bound to the event loop it is first used in.

    The sync methods (the EngineCoreClient ABC) are for other threads: they run the async
    variant on the client's loop and wait for it.
    """

    def __init__(self, config: KVServeConfig, addresses: Optional[ClientAddresses] = None) -> None:
        super().__init__(config, asyncio_mode=True, addresses=addresses)
        r = self.resources
        try:
            r.on_dead = functools.partial(_async_on_dead, r)
            self._start_monitor()
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass        # started lazily, by the first async call
            else:
                self._ensure_output_task()
        except BaseException:
            r.close()
            raise

    def _ensure_output_task(self) -> None:
        r = self.resources
        loop = asyncio.get_running_loop()
        if r.output_task is not None:
            if r.loop is not loop:
                raise RuntimeError("This AsyncMPClient is bound to another event loop.")
            return
        r.loop = loop
        r.outputs_queue = asyncio.Queue()
        r.output_task = loop.create_task(
            _async_output_reader(r, self.output_socket, self.decoder),
            name="EngineCoreOutputReader")
        if r.engine_dead:      # it died before we had a loop to tell
            r.outputs_queue.put_nowait(r.make_dead_error())

    async def _send_async(self, request_type: EngineCoreRequestType, obj: Any,
                          identity: Optional[bytes] = None) -> None:
        self._ensure_alive()
        self._ensure_output_task()
        await self.input_socket.send_multipart(self._frames(request_type, obj, identity),
                                               copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send_async(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not (self.resources.engine_dead or self.resources.closed):
            await self._send_async(EngineCoreRequestType.ABORT, list(request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_alive()
        self._ensure_output_task()
        assert isinstance(self.resources.outputs_queue, asyncio.Queue)
        out = await self.resources.outputs_queue.get()
        if isinstance(out, BaseException):
            raise out
        return out

    async def call_utility_async(self, method: str, *args: Any, engine_index: int = 0) -> Any:
        self._ensure_alive()
        self._ensure_output_task()
        r = self.resources
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        r.utility_futures[call_id] = fut
        try:
            await self._send_async(EngineCoreRequestType.UTILITY, (call_id, method, args),
                                   self.engine_identities[engine_index])
        except BaseException:
            r.utility_futures.pop(call_id, None)
            raise
        return await fut

    async def call_utility_all_async(self, method: str, *args: Any) -> dict[int, Any]:
        """The call on every engine (one without data parallelism), by engine index."""
        return {0: await self.call_utility_async(method, *args)}

    # ------------------------------------------------------------------ sync (other threads)
    def _run_on_loop(self, coro_fn: Callable[..., Any], *args: Any) -> Any:
        loop = self.resources.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is loop:
            raise RuntimeError("Called from the client's event loop: use the *_async method.")
        if loop is None or loop.is_closed() or not loop.is_running():
            raise RuntimeError("AsyncMPClient's sync methods need its event loop running in "
                               "another thread; use the *_async methods.")
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), loop).result()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._run_on_loop(self.add_request_async, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._run_on_loop(self.abort_requests_async, request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self._run_on_loop(self.get_output_async)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._run_on_loop(self.call_utility_async, method, *args)
