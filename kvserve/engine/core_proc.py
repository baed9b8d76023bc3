"""EngineCoreProc: EngineCore in its own process, talking to the frontend over ZMQ.

Start-up (the frontend binds every socket, the engine connects)::

    frontend (MPClient)                         engine core process
    handshake ROUTER  <─── HELLO ─────────────  DEALER
                      ──── init: addresses, config ──►
                                                load model, size the KV cache,
                                                start the IO threads
                      <─── READY num_gpu_blocks ──   (or FAILED: error + traceback)
    input ROUTER      <─── b"" (registration) ──  DEALER  (so the ROUTER knows our identity)

Steady state::

    input ROUTER ── [identity, type, *frames] ──► DEALER ─ input IO thread ─► input_queue
                                                                                 │
                                      busy loop: handle requests, EngineCore.step()
                                                                                 ▼
    output PULL  ◄──────────── [*frames] ──────── PUSH ◄─ output IO thread ◄─ output_queue

The busy loop blocks on `input_queue.get()` while there is nothing to schedule, so an idle
engine uses no CPU. Step outputs that no one reads before a request finishes (final-only
requests without stop strings, no stats kept) are held and sent together (OutputCoalescer):
on a CPU host each message takes CPU from the forward pass. Utility calls and aborts travel
on the same input socket as requests, so they are handled in order with them. A fatal error
is not swallowed: the engine sends ENGINE_CORE_DEAD with its traceback on the output socket
and exits; the frontend's monitor also notices the process exit by itself (SIGKILL, segfault).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional, Union

import msgspec
import zmq

from kvserve import envs
from kvserve.config import KVServeConfig
from kvserve.core.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest,
                                   EngineCoreRequestType, FinishReason)
from kvserve.engine.core import EngineCore
from kvserve.engine.output_coalescer import OutputCoalescer
from kvserve.engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from kvserve.executor.base import Executor
from kvserve.utils.memory import configure_process_memory

logger = logging.getLogger(__name__)

# First frame of the message an engine sends when it dies of an error; the second frame is
# its traceback text. (An EngineCoreOutputs encoding is a msgpack array, never this.)
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
HANDSHAKE_TIMEOUT_S = 5 * 60
# After the frontend died: how long a clean shut-down may take before the process hard-exits.
_ORPHAN_GRACE_S = 10.0
# After a fatal error: how long flushing ENGINE_CORE_DEAD and shutting down may take before
# the process hard-exits. A dead engine must not linger (once in CI it took over 30 s to
# leave through interpreter finalisation).
_FATAL_GRACE_S = 5.0
# Sent through input_queue by an IO thread that failed; the busy loop re-raises the error.
_IO_THREAD_FAILED = "IO_THREAD_FAILED"
# Sent through input_queue when a signal arrived: wakes the busy loop so that the main thread
# runs the Python signal handler (see run_engine_core).
_WAKE_UP = "WAKE_UP"


def dp_handshake_timeout_s() -> float:
    """KVSERVE_DP_HANDSHAKE_TIMEOUT: how long a headless engine (another node's) waits for the
    front node, and the front node for remote engines' HELLO."""
    return float(envs.get("KVSERVE_DP_HANDSHAKE_TIMEOUT"))


class EngineZmqAddresses(msgspec.Struct):
    inputs: list[str]
    outputs: list[str]


class EngineHandshakeMetadata(msgspec.Struct):
    """The frontend's answer to HELLO."""
    addresses: EngineZmqAddresses
    # Pickled KVServeConfig, for an engine the front started itself: it holds torch dtypes
    # and nested dataclasses, and both ends run the same code on the same machine.
    config: bytes = b""
    # For a headless engine (it has its own config): the DP fields to take from the front.
    parallel_config: dict[str, Any] = msgspec.field(default_factory=dict)
    # Why the front refuses this engine (it exits with this error).
    error: Optional[str] = None


def engine_identity(engine_index: int) -> bytes:
    """ZMQ identity of engine `engine_index` on the frontend's ROUTER sockets."""
    return engine_index.to_bytes(2, "little")


class EngineCoreProc(EngineCore):
    """ZMQ wrapper that runs EngineCore in a background process."""

    def __init__(self, handshake_address: str, engine_index: int = 0,
                 executor_class: Optional[type[Executor]] = None,
                 signal_wakeup_fd: Optional[int] = None,
                 config: Optional[KVServeConfig] = None) -> None:
        """`config`: a headless engine's own (another node's); otherwise the front's."""
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        # (client index, EngineCoreOutputs) to encode and send; a list of raw frames to send
        # to every client as they are; None to flush and stop the output thread.
        self.output_queue: queue.Queue[Union[tuple[int, EngineCoreOutputs], list[bytes], None]] = \
            queue.Queue()
        self.headless = config is not None
        self.num_clients = 1
        # Several API servers (clients): which one sent each running request.
        self._request_clients: dict[str, int] = {}
        self.engine_index = engine_index
        self.output_thread: Optional[threading.Thread] = None
        # How long the output socket may hold unsent messages at exit (0 once the frontend,
        # their only reader, is gone).
        self._output_linger_ms = 5_000
        # Set by shutdown(): past it, a send that would block is dropped (see _send).
        self._output_deadline: Optional[float] = None
        self._signal_wakeup_fd = signal_wakeup_fd
        identity = engine_identity(engine_index)
        with self._perform_handshake(handshake_address, identity, config) as init:
            if init.error is not None:
                raise RuntimeError(f"The front node refused this engine: {init.error}")
            if config is None:
                config = pickle.loads(init.config)
            else:
                for key, value in init.parallel_config.items():
                    setattr(config.parallel_config, key, value)
            assert config is not None
            self.num_clients = len(init.addresses.inputs)
            super().__init__(config, executor_class)     # loads the model, sizes the KV cache
            self.output_coalescer = OutputCoalescer(self.log_stats)
            try:
                self._start_io_threads(init.addresses, identity)
            except BaseException:
                self.model_executor.shutdown()
                raise

    def _start_io_threads(self, addresses: EngineZmqAddresses, identity: bytes) -> None:
        ready = threading.Event()
        input_thread = threading.Thread(
            target=self.process_input_sockets, args=(addresses.inputs, identity, ready),
            daemon=True, name="EngineCoreInputIO")
        input_thread.start()
        self.output_thread = threading.Thread(
            target=self.process_output_sockets, args=(addresses.outputs,),
            daemon=True, name="EngineCoreOutputIO")
        self.output_thread.start()
        # READY only once the input socket is connected and registered.
        while not ready.wait(timeout=1.0):
            if not input_thread.is_alive():
                raise RuntimeError("The engine core input IO thread failed to start.")

    # ------------------------------------------------------------------ handshake
    @contextmanager
    def _perform_handshake(self, handshake_address: str, identity: bytes,
                           config: Optional[KVServeConfig]) -> Iterator[EngineHandshakeMetadata]:
        """HELLO -> init message; the body of the `with` loads the engine; then READY, or
        FAILED with the error if the body raised."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(handshake_address)
        try:
            init = self.startup_handshake(sock, handshake_address, config)
            try:
                yield init
            except BaseException as e:
                sock.send(msgspec.msgpack.encode({
                    "status": "FAILED", "error_type": type(e).__name__, "error": str(e),
                    "traceback": traceback.format_exc()}))
                raise
            sock.send(msgspec.msgpack.encode({
                "status": "READY", "num_gpu_blocks": self.config.cache_config.num_blocks}))
        finally:
            # Linger: the last message must reach the frontend before this process may exit.
            sock.close(linger=2_000)
            ctx.term()

    @staticmethod
    def startup_handshake(sock: zmq.Socket, address: str,
                          config: Optional[KVServeConfig]) -> EngineHandshakeMetadata:
        headless = config is not None
        sock.send(msgspec.msgpack.encode({
            "status": "HELLO", "local": not headless, "headless": headless, "pid": os.getpid(),
            "data_parallel_size": config.parallel_config.data_parallel_size if config else None}))
        timeout = dp_handshake_timeout_s() if headless else HANDSHAKE_TIMEOUT_S
        deadline = time.monotonic() + timeout
        while not sock.poll(timeout=1000):
            if _parent_is_dead():
                raise SystemExit("The frontend process exited during the handshake.")
            if time.monotonic() > deadline:
                where = (f" at {address} within {timeout:.0f} s "
                         f"(KVSERVE_DP_HANDSHAKE_TIMEOUT): is the front node (`kvserve serve` "
                         f"without --headless) running and reachable?" if headless
                         else f" within {timeout:.0f} s.")
                raise RuntimeError(f"Did not receive the init message from the front end{where}")
        return msgspec.msgpack.decode(sock.recv(), type=EngineHandshakeMetadata)

    # ------------------------------------------------------------------ busy loop
    def run_busy_loop(self) -> None:
        """Runs until SIGTERM (SystemExit), a SHUTDOWN message or a fatal error."""
        while True:
            self._process_input_queue()
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        """Returns when there is work to step: blocks while there is none."""
        while not self.scheduler.has_unfinished_requests():
            self._handle_client_request(*self.input_queue.get())
        while True:      # handle whatever else has arrived before stepping
            try:
                request = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_client_request(*request)

    def _process_engine_step(self) -> None:
        outputs = self.output_coalescer.filter(self.step())
        if outputs is not None:
            self._send_outputs(outputs)
        elif not self.scheduler.has_unfinished_requests():
            self._send_held_outputs()     # nothing may wait on an idle engine

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.engine_index
        if outputs.outputs or outputs.finished_requests or outputs.scheduler_stats is not None:
            if self.num_clients == 1:
                self.output_queue.put_nowait((0, outputs))
            else:
                for client in self._split_by_client(outputs):
                    self.output_queue.put_nowait(client)

    def _send_held_outputs(self) -> None:
        """Before any other message: the frontend sees every message in engine order."""
        held = self.output_coalescer.flush()
        if held is not None:
            self._send_outputs(held)

    def _split_by_client(self, outputs: EngineCoreOutputs) -> list[tuple[int, EngineCoreOutputs]]:
        """Several API servers: each gets its own requests' outputs, and every one the
        scheduler stats."""
        by_client: dict[int, EngineCoreOutputs] = {}

        def of(client: int) -> EngineCoreOutputs:
            if client not in by_client:
                by_client[client] = EngineCoreOutputs(timestamp=outputs.timestamp,
                                                      engine_index=outputs.engine_index)
            return by_client[client]
        for out in outputs.outputs:
            client = (self._request_clients.pop(out.request_id, 0) if out.finished
                      else self._request_clients.get(out.request_id, 0))
            of(client).outputs.append(out)
        for rid in outputs.finished_requests or ():
            part = of(self._request_clients.pop(rid, 0))
            part.finished_requests = (part.finished_requests or set()) | {rid}
        if outputs.scheduler_stats is not None:
            for client in range(self.num_clients):
                of(client).scheduler_stats = outputs.scheduler_stats
        return list(by_client.items())

    def _handle_client_request(self, request_type: Any, request: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self._add_request_or_fail(request)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(request)
            self.output_coalescer.drop(request)
            if self.num_clients > 1:
                for rid in request:
                    self._request_clients.pop(rid, None)
        elif request_type == EngineCoreRequestType.UTILITY:
            client, call_id, method_name, args = request
            self._call_utility(client, call_id, method_name, args)
        elif request_type == EngineCoreRequestType.SHUTDOWN:
            raise SystemExit(0)
        elif request_type == _WAKE_UP:
            pass        # the pending signal handler runs now, in this (the main) thread
        elif request_type == _IO_THREAD_FAILED:
            raise RuntimeError("An engine core IO thread failed.") from request
        else:
            raise RuntimeError(f"Unknown request type {request_type!r}.")

    def _add_request_or_fail(self, request: EngineCoreRequest) -> None:
        # One bad request must not take the engine down: it finishes with "error".
        try:
            self.add_request(request)
        except Exception:
            logger.exception("Request %s could not be added; finishing it with an error.",
                             request.request_id)
            self._send_held_outputs()
            self.output_queue.put_nowait((request.client_index, EngineCoreOutputs(
                outputs=[EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                          finish_reason=FinishReason.ERROR)],
                timestamp=time.monotonic())))
            return
        self.output_coalescer.add_request(request)
        if self.num_clients > 1:
            self._request_clients[request.request_id] = request.client_index

    def _call_utility(self, client: int, call_id: int, method_name: str, args: list[Any]) -> None:
        result, failure = None, None
        try:
            if method_name.startswith("_"):
                raise AttributeError(f"{method_name!r} is private.")
            result = getattr(self, method_name)(*args)
        except Exception as e:
            failure = f"Call to {method_name} failed: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        self._send_held_outputs()
        self.output_queue.put_nowait((client, EngineCoreOutputs(
            utility_output=(call_id, failure, result))))

    # ------------------------------------------------------------------ utilities
    def check_health(self) -> bool:
        self.model_executor.check_health()
        return True

    # ------------------------------------------------------------------ IO threads
    def process_input_sockets(self, input_addresses: list[str], identity: bytes,
                              ready: threading.Event) -> None:
        """Input IO thread: receive (from every API server), decode, and put on input_queue."""
        try:
            add_decoder = MsgpackDecoder(EngineCoreRequest)
            generic_decoder = MsgpackDecoder()
            parent_fd = _parent_sentinel()
            ctx = zmq.Context()
            poller = zmq.Poller()
            sockets: dict[zmq.Socket, int] = {}
            for client, address in enumerate(input_addresses):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, identity)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                sock.send(b"")       # registration: the ROUTER can address us from now on
                poller.register(sock, zmq.POLLIN)
                sockets[sock] = client
            # A headless engine's front is not its parent: its connection closing is the sign.
            monitor = (next(iter(sockets)).get_monitor_socket(zmq.EVENT_DISCONNECTED)
                       if self.headless else None)
            for fd in (parent_fd, self._signal_wakeup_fd, monitor):
                if fd is not None:
                    poller.register(fd, zmq.POLLIN)
            ready.set()
            # With the parent's sentinel in the poller this wakes only for messages;
            # without it, check the parent every second.
            timeout = None if parent_fd is not None else 1000
            while True:
                events = dict(poller.poll(timeout))
                if (parent_fd is not None and parent_fd in events) or (
                        parent_fd is None and _parent_is_dead()) or (
                        monitor is not None and monitor in events):
                    self._on_frontend_death()
                    return
                if self._signal_wakeup_fd is not None and self._signal_wakeup_fd in events:
                    os.read(self._signal_wakeup_fd, 512)
                    self.input_queue.put_nowait((_WAKE_UP, None))
                for sock, client in sockets.items():
                    if sock in events:
                        self._receive(sock, client, add_decoder, generic_decoder)
        except Exception as e:
            logger.exception("Engine core input IO thread failed.")
            self.input_queue.put_nowait((_IO_THREAD_FAILED, e))

    def _receive(self, sock: zmq.Socket, client: int, add_decoder: MsgpackDecoder,
                 generic_decoder: MsgpackDecoder) -> None:
        type_frame, *data_frames = sock.recv_multipart(copy=False)
        request_type = EngineCoreRequestType(bytes(type_frame.buffer))
        request: Any
        if request_type == EngineCoreRequestType.ADD:
            request = add_decoder.decode(data_frames)
            request.client_index = client       # where its outputs go
        elif request_type == EngineCoreRequestType.SHUTDOWN:
            request = None
        elif request_type == EngineCoreRequestType.UTILITY:   # [call_id, method, args]
            request = [client, *generic_decoder.decode(data_frames)]
        else:     # ABORT: list of ids
            request = generic_decoder.decode(data_frames)
        self.input_queue.put_nowait((request_type, request))

    def process_output_sockets(self, output_addresses: list[str]) -> None:
        """Output IO thread: take from output_queue, encode, send to its API server."""
        try:
            encoder = MsgpackEncoder()
            ctx = zmq.Context()
            sockets = []
            for address in output_addresses:
                sock = ctx.socket(zmq.PUSH)
                sock.connect(address)
                sockets.append(sock)
            while True:
                item = self.output_queue.get()
                if item is None:
                    break
                if isinstance(item, list):      # ENGINE_CORE_DEAD: every client
                    for sock in sockets:
                        self._send(sock, item)
                    continue
                client, outputs = item
                try:
                    buffers = encoder.encode(outputs)
                except Exception as e:
                    if outputs.utility_output is None:
                        raise
                    # A utility result that cannot be encoded fails that call, not the engine.
                    call_id = outputs.utility_output[0]
                    buffers = encoder.encode(EngineCoreOutputs(utility_output=(
                        call_id, f"Cannot send the result: {type(e).__name__}: {e}", None)))
                self._send(sockets[client], buffers, copy=False)
            # Flush what was queued before the sentinel, then stop.
            for sock in sockets:
                sock.close(linger=self._output_linger_ms)
            ctx.term()
        except Exception as e:
            logger.exception("Engine core output IO thread failed.")
            self.input_queue.put_nowait((_IO_THREAD_FAILED, e))

    def _send(self, sock: zmq.Socket, frames: list[Any], copy: bool = True) -> None:
        """Send, waiting while the API server's queue is full (back-pressure), but not past
        the shut-down's deadline: one of several API servers that died never reads its
        socket again, and a blocking send would hold the one output thread for ever (and
        the others' outputs, and the flush before exit, behind it)."""
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                return
            except zmq.Again:
                deadline = self._output_deadline
                if deadline is not None and time.monotonic() >= deadline:
                    logger.warning("Shutting down: dropping an output for an API server that "
                                   "does not read its socket (it died).")
                    return
                sock.poll(100, zmq.POLLOUT)

    def _on_frontend_death(self) -> None:
        logger.warning("The frontend process died; engine core shutting down.")
        self._output_linger_ms = 0
        self.input_queue.put_nowait((EngineCoreRequestType.SHUTDOWN, None))
        # If the busy loop is stuck in a step, do not outlive the frontend for long.
        timer = threading.Timer(_ORPHAN_GRACE_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    # ------------------------------------------------------------------ exit
    def send_engine_dead(self, tb: str) -> None:
        self.output_queue.put_nowait([ENGINE_CORE_DEAD, tb.encode()])

    def shutdown(self) -> None:
        # Deliver what is queued (ENGINE_CORE_DEAD included) before tearing the executor down.
        self.shutdown_output_thread()
        super().shutdown()

    def shutdown_output_thread(self) -> None:
        """Flush what is queued and stop the output thread."""
        if self.output_thread is not None and self.output_thread.is_alive():
            # Told to stop (linger 0), do not wait long: the thread drops what a dead API
            # server's socket (one of several) does not take by then.
            wait_s = 5.0 if self._output_linger_ms else 0.5
            self._output_deadline = time.monotonic() + wait_s
            self.output_queue.put_nowait(None)
            self.output_thread.join(timeout=wait_s + 1.0)
            if self.output_thread.is_alive():
                logger.warning("The engine core output thread did not stop in %.1f s.", wait_s)


def _parent_sentinel() -> Optional[int]:
    """A file descriptor that becomes readable when the parent (frontend) process exits."""
    parent = multiprocessing.parent_process()
    return parent.sentinel if parent is not None else None


def _parent_is_dead() -> bool:
    parent = multiprocessing.parent_process()
    if parent is not None:
        return not parent.is_alive()
    return os.getppid() == 1


def run_engine_core(handshake_address: str, engine_index: int = 0,
                    log_level: Optional[int] = None, data_parallel: bool = False,
                    config: Optional[KVServeConfig] = None) -> None:
    """Entry point of the engine core process (multiprocessing `spawn` target)."""
    if log_level is not None:
        logging.basicConfig(level=log_level,
                            format=f"%(levelname)s %(asctime)s [EngineCore_{engine_index}] "
                                   f"%(name)s: %(message)s")
    configure_process_memory("Engine core", owns_engine=True)
    exiting = False

    def signal_handler(signum: int, frame: Any) -> None:
        # Raise once, in the main thread; never while the shut-down itself is running.
        nonlocal exiting
        if not exiting:
            exiting = True
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, signal_handler)
    # The kernel may hand SIGTERM to any thread. Python runs the handler in the main thread,
    # but only once that thread runs bytecode, and an idle busy loop is blocked on a lock
    # that a signal received elsewhere does not interrupt. The wakeup fd (written by the C
    # handler, whichever thread it runs in) lets the input thread wake the busy loop.
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
    # Ctrl-C in a terminal reaches the whole process group. The frontend owns this process's
    # lifetime (it aborts its requests on KeyboardInterrupt and may go on using the engine;
    # when it exits it stops us, and if it dies we notice), so the engine ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    engine: Optional[EngineCoreProc] = None
    exit_code = 0
    told_to_stop = False
    try:
        engine_class = EngineCoreProc
        if data_parallel:
            from kvserve.engine.dp_core import DPEngineCoreProc
            from kvserve.executor.multiproc import _set_process_name
            _set_process_name(f"KVSEngine_DP{engine_index}")
            engine_class = DPEngineCoreProc
        engine = engine_class(handshake_address, engine_index, signal_wakeup_fd=wakeup_r,
                              config=config)
        engine.run_busy_loop()
    except SystemExit:
        logger.debug("Engine core shutting down.")
        told_to_stop = True
        if engine is not None:
            # Told to stop (SIGTERM, SHUTDOWN): no frontend waits for more outputs, and one
            # of several API servers may be dead, the output thread blocked sending to it
            # (the exit took 5 s when one of `--api-server-count 2` was killed).
            engine._output_linger_ms = 0
    except Exception:
        exit_code = 1
        if engine is None:
            # The frontend got the error and traceback through the handshake (FAILED).
            logger.exception("Engine core failed to start.")
        else:
            logger.exception("Engine core encountered a fatal error.")
            engine.send_engine_dead(traceback.format_exc())
            _hard_exit_after(_FATAL_GRACE_S, exit_code)
    finally:
        exiting = True
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("Engine core shut-down failed.")
    if exit_code or told_to_stop:
        # ENGINE_CORE_DEAD is delivered (or no one waits for outputs) and the executor is
        # down: nothing is left that needs the interpreter's finalisation, which can stall on
        # threads and native pools (over 5 s after one of `--api-server-count 2` was killed,
        # the IO threads' zmq sockets still open to it).
        _flush_and_exit(exit_code)


def _hard_exit_after(seconds: float, code: int) -> None:
    timer = threading.Timer(seconds, _flush_and_exit, args=(code,))
    timer.daemon = True
    timer.start()


def _flush_and_exit(code: int) -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
