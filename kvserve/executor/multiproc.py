"""MultiprocExecutor: one worker process per rank, driven over shared-memory message queues.

    executor (engine core process)                       worker processes (spawned)
    ┌───────────────────────────────┐   rpc_broadcast_mq   ┌─ WorkerProc rank 0 ─────────────┐
    │ collective_rpc(method, args,  │ ───────────────────► │ dequeue -> getattr(worker, m)() │
    │   kwargs, unique_reply_rank)  │ (1 writer, W readers)│ -> enqueue if it answers        │
    │                               │ ◄─────────────────── └─────────────────────────────────┘
    │ response_mqs[r].dequeue()     │  worker_response_mq     ... rank W-1 (same loop)
    │ monitor thread: sentinels     │  (one per rank, 1 reader)
    └───────────────────────────────┘        ranks talk to each other over torch.distributed

A message on ``rpc_broadcast_mq`` is ``(method name, args, kwargs, output_rank)``; every rank
runs it, and only ``output_rank`` answers (every rank when it is None). Replies are
``(SUCCESS, value)`` or ``(FAILURE, worker traceback text)``.

Start-up: the executor creates ``rpc_broadcast_mq`` and spawns one process per rank with its
handle and a ``tcp://127.0.0.1:PORT`` rendezvous address for torch.distributed. Each child
attaches to the broadcast queue, creates its own response queue, initialises its device
(joining the process group) and loads the model, then sends READY with its response-queue
handle over a pipe; a failure sends its traceback instead, and the executor raises it and
ends the other workers. Then both sides run the queues' ready handshakes.

Failure: a monitor thread waits on the worker processes' sentinels. When one dies outside a
shut-down it marks the executor failed (pending and later calls raise ``WorkerDeadError``
naming the rank) and ends the remaining workers. Workers leave on their own when their
parent process dies.

Everything shut-down must release lives in ``_ExecutorResources``, which never refers back to
the executor: the executor can be garbage collected, and a finalizer still ends the workers
and unlinks every shared-memory segment (also at interpreter exit).
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Optional, Union

from kvserve import envs
from kvserve.config import KVServeConfig
from kvserve.distributed.shm_broadcast import Handle, MessageQueue, MessageQueueCancelled
from kvserve.executor.base import Executor
from kvserve.utils.memory import configure_process_memory

logger = logging.getLogger(__name__)

SUCCESS, FAILURE = 0, 1
READY_STR, FAILED_STR = "READY", "FAILED"

# How long the executor waits for every worker to load its model and report READY.
# The queues' ready handshake runs right after READY; it only waits for sockets to connect.
_HANDSHAKE_TIMEOUT_S = 60.0
# How often an idle or blocked worker checks that its parent is still alive.
_PARENT_CHECK_S = 1.0
# After a failed RPC, how long to watch for a dead peer (the usual cause with TP > 1).
_PEER_DEATH_GRACE_S = 0.25
# On shut-down, how long workers get to exit after SIGTERM before SIGKILL.
_TERMINATE_GRACE_S = 4.0


class WorkerDeadError(RuntimeError):
    """A worker process died (or the executor was shut down); this executor runs nothing more."""


class WorkerRPCError(RuntimeError):
    """The method raised in a worker; the message carries the worker's traceback. The worker
    (and the executor) keep running."""


def _get_open_port() -> int:
    # Port 0: the OS picks a free one, so two engines on one machine never collide. The
    # window between closing it here and rank 0 binding it is tiny.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _unlink_leftovers(handle: Handle) -> None:
    """Remove the segment and IPC socket file of a queue whose writer could not clean up
    (a worker killed with SIGKILL). No-op when the writer already did."""
    if handle.shm_name:
        from kvserve.distributed.shm_broadcast import _attach_untracked
        try:
            shm = _attach_untracked(handle.shm_name)
        except FileNotFoundError:
            pass
        else:
            shm.close()
            try:
                # Also tells the resource tracker (which the spawned writer shared with us)
                # that the name is gone, so it does not warn about a leak at exit.
                shm.unlink()
            except FileNotFoundError:
                pass
    addr = handle.local_subscribe_addr
    if addr and addr.startswith("ipc://"):
        try:
            os.unlink(addr[len("ipc://"):])
        except FileNotFoundError:
            pass


@dataclass
class WorkerProcHandle:
    """The executor's view of one worker process."""
    proc: BaseProcess
    rank: int
    ready_pipe: Optional[multiprocessing.connection.Connection] = None
    response_handle: Optional[Handle] = None


@dataclass
class _ExecutorResources:
    """What shut-down releases. Shared by the executor, its monitor thread and its finalizer;
    holds no reference to the executor."""
    workers: list[WorkerProcHandle] = field(default_factory=list)
    rpc_broadcast_mq: Optional[MessageQueue] = None
    response_mqs: list[MessageQueue] = field(default_factory=list)
    # Set on failure and on shut-down: wakes any call blocked on a queue.
    stop_event: threading.Event = field(default_factory=threading.Event)
    failure_reason: Optional[str] = None
    shutting_down: bool = False
    monitor: Optional[threading.Thread] = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The monitor thread and shut-down may both end workers; two threads reaping one
    # process would confuse multiprocessing's bookkeeping.
    end_lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, reason: str) -> None:
        with self.lock:
            if self.failure_reason is None:
                self.failure_reason = reason
        self.stop_event.set()

    def end_workers(self, grace_s: float = _TERMINATE_GRACE_S) -> None:
        """SIGTERM (workers clean up their own queues), then SIGKILL after `grace_s`; reap all."""
        with self.end_lock:
            self._end_workers(grace_s)

    def _end_workers(self, grace_s: float) -> None:
        procs = [w.proc for w in self.workers]
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace_s
        alive = [p for p in procs if p.exitcode is None]
        while alive and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in alive],
                                            timeout=deadline - time.monotonic())
            alive = [p for p in alive if p.exitcode is None]
        for p in alive:
            logger.warning("Worker pid %d did not exit after SIGTERM; killing it", p.pid)
            p.kill()
        for p in procs:
            p.join()

    def shutdown(self) -> None:
        """End the workers, close every queue, remove every segment. Idempotent."""
        with self.lock:
            if self.shutting_down:
                return
            self.shutting_down = True
        self.stop_event.set()
        self.end_workers()
        # Its wait on the sentinels has returned (every worker is gone); join it before the
        # sentinels' file descriptors are closed below.
        if self.monitor is not None and self.monitor is not threading.current_thread():
            self.monitor.join(timeout=10)
        for w in self.workers:
            if w.ready_pipe is not None:
                w.ready_pipe.close()
                w.ready_pipe = None
            w.proc.close()
        for mq in self.response_mqs:
            mq.close()
        if self.rpc_broadcast_mq is not None:
            self.rpc_broadcast_mq.close()
        for w in self.workers:
            if w.response_handle is not None:
                _unlink_leftovers(w.response_handle)


def _monitor_workers(resources: _ExecutorResources,
                     callback_ref: Callable[[], Optional[Callable[[], None]]]) -> None:
    """Monitor thread: wait for any worker to exit; outside a shut-down that is a failure."""
    sentinels = {w.proc.sentinel: w for w in resources.workers}
    ready = multiprocessing.connection.wait(list(sentinels))
    if resources.shutting_down:
        return
    dead = sentinels[ready[0]]
    # The sentinel closes while the process is exiting; reap it to learn how it ended.
    with resources.end_lock:
        dead.proc.join(timeout=1.0)
    reason = (f"Worker process of rank {dead.rank} (pid {dead.proc.pid}) "
              f"{_describe_exit(dead.proc.exitcode)}; the executor has stopped and the "
              f"remaining workers were ended.")
    logger.error(reason)
    resources.fail(reason)
    with resources.lock:
        if resources.shutting_down:
            return
    # The other ranks cannot continue without their peer (collectives would hang).
    resources.end_workers(grace_s=2.0)
    callback = callback_ref()
    if callback is not None:
        try:
            callback()
        except Exception:
            logger.exception("Executor failure callback raised")


class FutureWrapper(Future):
    """Result of ``collective_rpc(non_block=True)``. Replies arrive in call order on each
    rank's queue, so waiting on it first reads the replies of earlier non-blocking calls."""

    def __init__(self, drain: Callable[["FutureWrapper"], None]) -> None:
        super().__init__()
        self._drain = drain

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self.done():
            self._drain(self)   # the RPC's own timeout applies while reading
        return super().result(timeout=0)


class _FirstReply:
    """A FutureWrapper of a one-reply list, as a future of that reply."""

    def __init__(self, future: FutureWrapper) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._future.result(timeout)[0]


class MultiprocExecutor(Executor):
    """Executor over ``world_size`` worker processes on this machine (TP ranks).

    Not thread-safe: one thread (the engine core's busy loop) issues the calls.
    """

    def _init_executor(self) -> None:
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        self._resources = resources = _ExecutorResources()
        self._stop_event = resources.stop_event
        self._failure_callback: Optional[Callable[[], None]] = None
        self._pending: deque[tuple[FutureWrapper, tuple[int, ...], str, Optional[float]]] = deque()
        # Replies still owed by a rank for calls that timed out: skipped when they arrive.
        self._stale = [0] * self.world_size
        self._all_ranks = tuple(range(self.world_size))
        self._one_rank = [(r,) for r in range(self.world_size)]
        # Registered first: even a failed start-up leaves no process or segment behind.
        self._finalizer = weakref.finalize(self, resources.shutdown)
        try:
            self._start_workers()
        except BaseException:
            self._finalizer()
            raise
        resources.monitor = threading.Thread(
            target=_monitor_workers, args=(resources, self._get_failure_callback_ref()),
            daemon=True, name="MultiprocWorkerMonitor")
        resources.monitor.start()

    # ------------------------------------------------------------------ start-up
    def _start_workers(self) -> None:
        r = self._resources
        distributed_init_method = f"tcp://127.0.0.1:{_get_open_port()}"
        r.rpc_broadcast_mq = MessageQueue(self.world_size, self.world_size)
        handle = r.rpc_broadcast_mq.export_handle()
        for rank in range(self.world_size):
            r.workers.append(WorkerProc.make_worker_process(
                self.config, local_rank=rank, rank=rank,
                distributed_init_method=distributed_init_method, input_shm_handle=handle))
        self._wait_for_ready(r.workers)
        r.response_mqs = [MessageQueue.create_from_handle(w.response_handle, 0)
                          for w in r.workers]
        # Writer side first: it sends READY once every rank has subscribed, which the workers
        # wait for before they, as writers of their response queues, wait for us.
        r.rpc_broadcast_mq.wait_until_ready(timeout=_HANDSHAKE_TIMEOUT_S)
        for mq in r.response_mqs:
            mq.wait_until_ready(timeout=_HANDSHAKE_TIMEOUT_S)

    @staticmethod
    def _wait_for_ready(workers: list[WorkerProcHandle]) -> None:
        """Collect READY (and the response-queue handle) from every worker; the first failure
        or death raises with the worker's own traceback."""
        pending = {w.ready_pipe: w for w in workers}
        by_sentinel = {w.proc.sentinel: w for w in workers}
        ready_timeout = float(envs.get("KVSERVE_WORKER_READY_TIMEOUT_S"))
        deadline = time.monotonic() + ready_timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"Workers of ranks {sorted(w.rank for w in pending.values())} did not "
                    f"report READY within {ready_timeout:.0f} s "
                    f"(KVSERVE_WORKER_READY_TIMEOUT_S).")
            ready = multiprocessing.connection.wait(
                list(pending) + [s for s, w in by_sentinel.items() if w.ready_pipe in pending],
                timeout=left)
            for obj in ready:
                w = pending.get(obj) or by_sentinel[obj]
                if w.ready_pipe not in pending:
                    continue
                try:
                    msg = w.ready_pipe.recv()
                except EOFError:
                    w.proc.join(timeout=5)
                    raise RuntimeError(
                        f"Worker process of rank {w.rank} {_describe_exit(w.proc.exitcode)} "
                        f"during start-up before reporting (see its output above).") from None
                if msg["status"] != READY_STR:
                    raise RuntimeError(f"Worker of rank {w.rank} failed during start-up:\n"
                                       f"{msg['error']}")
                w.response_handle = msg["handle"]
                del pending[w.ready_pipe]
                w.ready_pipe.close()
                w.ready_pipe = None

    # ------------------------------------------------------------------ failure
    def _get_failure_callback_ref(self) -> Callable[[], Optional[Callable[[], None]]]:
        ref = weakref.ref(self)

        def get() -> Optional[Callable[[], None]]:
            executor = ref()
            return executor._failure_callback if executor is not None else None
        return get

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """`callback()` runs (on the monitor thread) when a worker dies; at once if one has."""
        if self.is_failed:
            callback()
        else:
            self._failure_callback = callback

    @property
    def is_failed(self) -> bool:
        return self._resources.failure_reason is not None

    def _dead_error(self) -> WorkerDeadError:
        r = self._resources
        if r.failure_reason is not None:
            return WorkerDeadError(r.failure_reason)
        if r.shutting_down:
            return WorkerDeadError("The executor has been shut down.")
        return WorkerDeadError("A worker process exited; the executor has stopped.")

    # ------------------------------------------------------------------ RPC
    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None,
                       unique_reply_rank: Optional[int] = None, non_block: bool = False,
                       timeout: Optional[float] = None) -> Union[list[Any], FutureWrapper]:
        """Run `method` on every rank. Returns the replies of all ranks in rank order, or a
        one-element list with the reply of `unique_reply_rank` (the other ranks stay silent).
        With `non_block` a Future of that list comes back at once."""
        if self._stop_event.is_set():
            raise self._dead_error()
        if unique_reply_rank is None:
            ranks = self._all_ranks
        else:
            if not 0 <= unique_reply_rank < self.world_size:
                raise ValueError(f"unique_reply_rank {unique_reply_rank} is not in "
                                 f"[0, {self.world_size})")
            ranks = self._one_rank[unique_reply_rank]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._resources.rpc_broadcast_mq.enqueue(
                (method, args, kwargs, unique_reply_rank), timeout=timeout, cancel=self._stop_event)
        except MessageQueueCancelled:
            raise self._dead_error() from None
        except TimeoutError:
            raise TimeoutError(f"RPC {method!r}: the workers did not take the call within "
                               f"{timeout} s (the broadcast ring is full).") from None
        if non_block:
            future = FutureWrapper(self._drain_pending)
            self._pending.append((future, ranks, method, deadline))
            return future
        if self._pending:
            self._drain_pending()
        return self._read_replies(ranks, method, deadline)

    def _drain_pending(self, until: Optional[FutureWrapper] = None) -> None:
        """Read the replies of earlier non-blocking calls, in order (up to `until`)."""
        while self._pending:
            future, ranks, method, deadline = self._pending.popleft()
            try:
                future.set_result(self._read_replies(ranks, method, deadline))
            except Exception as e:   # belongs to that call: raised by its result()
                future.set_exception(e)
            except BaseException as e:   # e.g. Ctrl-C while reading: the future fails too
                future.set_exception(e)
                raise
            if future is until:
                return

    def _read_replies(self, ranks: tuple[int, ...], method: str,
                      deadline: Optional[float]) -> list[Any]:
        results: list[Any] = []
        failure: Optional[tuple[int, str]] = None
        for i, rank in enumerate(ranks):
            try:
                while self._stale[rank]:
                    self._dequeue(rank, deadline)
                    self._stale[rank] -= 1
                status, value = self._dequeue(rank, deadline)
            except TimeoutError:
                for r in ranks[i:]:
                    self._stale[r] += 1
                raise TimeoutError(f"RPC {method!r} timed out waiting for rank {rank}") from None
            if status == SUCCESS:
                results.append(value)
            elif failure is None:
                # Keep reading: the other ranks' replies must not be left in their queues.
                failure = (rank, value)
        if failure is not None:
            # A collective that failed because its peer died: report the death, not the
            # symptom (a closed gloo connection).
            self._check_workers_alive()
            raise WorkerRPCError(f"Worker of rank {failure[0]} failed in {method!r}:\n{failure[1]}")
        return results

    def _dequeue(self, rank: int, deadline: Optional[float]) -> Any:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return self._resources.response_mqs[rank].dequeue(timeout=timeout,
                                                              cancel=self._stop_event)
        except MessageQueueCancelled:
            raise self._dead_error() from None

    def _check_workers_alive(self) -> None:
        # A collective that failed on one rank usually means a peer died; its sentinel may
        # close a moment after the peer's sockets did, so give it a short while (this is only
        # the error path). The monitor thread sees the same sentinel and marks the failure.
        sentinels = [w.proc.sentinel for w in self._resources.workers]
        grace = _PEER_DEATH_GRACE_S if self.world_size > 1 else 0.0
        if multiprocessing.connection.wait(sentinels, timeout=grace):
            self._stop_event.wait(timeout=5.0)
            raise self._dead_error()

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        """One step; only `output_rank` answers. With `non_block` (the engine core's batch
        queue, one batch per pipeline stage in flight) a Future of the output comes back
        as soon as the call is on the broadcast queue."""
        reply = self.collective_rpc("execute_model", (scheduler_output,),
                                    unique_reply_rank=self.output_rank, non_block=non_block)
        if not non_block:
            return reply[0]
        return _FirstReply(reply)

    def check_health(self) -> None:
        if self._stop_event.is_set():
            raise self._dead_error()
        self.collective_rpc("check_health", timeout=60.0)

    def shutdown(self) -> None:
        """End the workers and release every queue and segment. Idempotent."""
        self._finalizer()


class WorkerProc:
    """Runs in each worker process: a Worker plus the two queues and the busy loop."""

    def __init__(self, config: KVServeConfig, local_rank: int, rank: int,
                 distributed_init_method: str, input_shm_handle: Handle, parent_pid: int) -> None:
        from kvserve.worker.worker import Worker

        self.rank = rank
        self.parent_pid = parent_pid
        self.rpc_broadcast_mq: Optional[MessageQueue] = None
        self.worker_response_mq: Optional[MessageQueue] = None
        self.worker = Worker(config, local_rank=local_rank, rank=rank,
                             distributed_init_method=distributed_init_method)
        try:
            self.rpc_broadcast_mq = MessageQueue.create_from_handle(input_shm_handle, rank)
            self.worker.init_device()   # joins the process group (blocks until every rank does)
            self.worker.load_model()
            # Created last: a worker killed while loading leaves no segment behind, and the
            # executor learns this one's name (to clean up after a SIGKILL) with READY.
            self.worker_response_mq = MessageQueue(1, 1)
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def make_worker_process(config: KVServeConfig, local_rank: int, rank: int,
                            distributed_init_method: str,
                            input_shm_handle: Handle) -> WorkerProcHandle:
        # spawn, never fork: a forked child would inherit the parent's threads and torch state.
        ctx = multiprocessing.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=WorkerProc.worker_main, name=f"KVServeWorker-TP{rank}",
            kwargs=dict(config=config, local_rank=local_rank, rank=rank,
                        distributed_init_method=distributed_init_method,
                        input_shm_handle=input_shm_handle, ready_pipe=writer,
                        parent_pid=os.getpid()),
            # daemon: multiprocessing's exit hook ends workers the executor did not.
            daemon=True)
        proc.start()
        writer.close()   # the child holds the only write end: EOF here means it died
        return WorkerProcHandle(proc=proc, rank=rank, ready_pipe=reader)

    @staticmethod
    def worker_main(*, ready_pipe: multiprocessing.connection.Connection, **kwargs: Any) -> None:
        """Process entry point: start up, report READY (or the error), serve until told to stop."""
        rank = kwargs["rank"]
        _set_process_name(f"KVSWorker_TP{rank}")
        configure_process_memory(f"Worker TP{rank}", owns_engine=True)
        shutdown_requested = False

        def on_sigterm(signum: int, frame: Any) -> None:
            nonlocal shutdown_requested
            if not shutdown_requested:   # once: the clean-up below must not be interrupted
                shutdown_requested = True
                raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_sigterm)
        # Ctrl-C reaches the whole process group; the executor decides when workers stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        worker: Optional[WorkerProc] = None
        try:
            try:
                worker = WorkerProc(**kwargs)
            except Exception:
                # The executor raises this traceback; no need to log it here as well.
                if not shutdown_requested:
                    ready_pipe.send({"status": FAILED_STR, "error": traceback.format_exc()})
                raise SystemExit(1)
            ready_pipe.send({"status": READY_STR,
                             "handle": worker.worker_response_mq.export_handle()})
            ready_pipe.close()
            worker.wait_until_ready()
            worker.worker_busy_loop()
        except Exception:   # SystemExit (shut-down, orphaned) passes through with its code
            logger.exception("Worker of rank %d failed", rank)
            raise SystemExit(1)
        finally:
            # A SIGTERM now must not cut the clean-up short (SIGKILL follows if it hangs).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if worker is not None:
                worker.shutdown()

    def _parent_alive(self) -> bool:
        # Re-parented (to init or a subreaper) once the parent exits.
        return os.getppid() == self.parent_pid

    def _exit_if_orphaned(self) -> None:
        if not self._parent_alive():
            logger.error("Worker of rank %d: the executor process %d is gone; exiting",
                         self.rank, self.parent_pid)
            raise SystemExit(1)

    def wait_until_ready(self) -> None:
        """The queues' handshakes; re-tried in short slices so an orphan does not hang here."""
        for mq in (self.rpc_broadcast_mq, self.worker_response_mq):
            while True:
                try:
                    mq.wait_until_ready(timeout=_PARENT_CHECK_S)
                    break
                except TimeoutError:
                    self._exit_if_orphaned()

    def worker_busy_loop(self) -> None:
        """dequeue -> run -> answer, forever. Returns only through SystemExit."""
        dequeue = self.rpc_broadcast_mq.dequeue
        worker, rank = self.worker, self.rank
        while True:
            try:
                method, args, kwargs, output_rank = dequeue(timeout=_PARENT_CHECK_S)
            except TimeoutError:   # idle: the only place worth checking on the parent
                self._exit_if_orphaned()
                continue
            try:
                func = getattr(worker, method)
                output = func(*args, **kwargs) if kwargs else func(*args)
            except Exception:
                if output_rank is None or output_rank == rank:
                    self._enqueue_output((FAILURE, traceback.format_exc()))
                else:
                    logger.exception("Worker of rank %d failed in %r", rank, method)
                continue
            if output_rank is None or output_rank == rank:
                self._enqueue_output((SUCCESS, output))

    def _enqueue_output(self, reply: tuple[int, Any]) -> None:
        while True:
            try:
                self.worker_response_mq.enqueue(reply, timeout=_PARENT_CHECK_S)
                return
            except TimeoutError:   # the executor is not reading: is it still there?
                self._exit_if_orphaned()

    def shutdown(self) -> None:
        # Queues first: the response segment is ours to unlink, whatever happens next.
        for mq in (self.rpc_broadcast_mq, self.worker_response_mq):
            if mq is not None:
                mq.close()
        try:
            self.worker.shutdown()
        except Exception:
            logger.exception("Worker of rank %d: error while shutting down", self.rank)


def _set_process_name(name: str) -> None:
    """Name the process for `ps`/`top` (Linux; at most 15 characters are kept)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
