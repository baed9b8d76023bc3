"""Starting the engine cores: this node's engine processes and the start-up handshake.

    CoreEngineProcManager   starts this node's engine processes (DP ranks
                            [data_parallel_start_rank, + data_parallel_size_local)); used by
                            the front node and by a `--headless` node alike.
    launch_core_engines     the front node: the DP group's store and coordinator, its own
                            engines, then the handshake with every engine of the group.

Handshake (seed 001's shape; the front binds, every engine connects)::

    engine DEALER ── HELLO {headless, dp_size, pid} ──► front handshake ROUTER
                  ◄─ init: addresses (+ config) ────
                     load the model, start the IO threads
                  ── READY num_gpu_blocks / FAILED ─►

One node: every address is an `ipc://` path. Engines on other nodes (`data_parallel_size_local
< data_parallel_size`): the handshake listens on `tcp://data_parallel_address:
data_parallel_rpc_port` and every other socket on a free TCP port of that address. A local
engine gets the front's pickled config; a headless engine built its own from its command line
and takes only the DP fields (store, coordinator) from the init message, as vLLM's engines do.

Nothing waits forever: a headless engine that cannot reach the front, and a front whose
remote engines do not say HELLO, give up after KVSERVE_DP_HANDSHAKE_TIMEOUT seconds (60).
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
from typing import Any, Optional

import msgspec
import zmq

from kvserve import envs
from kvserve.config import KVServeConfig, ParallelConfig
from kvserve.engine.core_proc import (EngineHandshakeMetadata, EngineZmqAddresses,
                                      dp_handshake_timeout_s, engine_identity, run_engine_core)

logger = logging.getLogger(__name__)

# The ParallelConfig fields a headless engine takes from the front's init message.
_DP_INIT_FIELDS = ("data_parallel_master_addr", "data_parallel_master_port",
                   "dp_coordinator_input", "dp_coordinator_engines")


def startup_timeout_s() -> float:
    """KVSERVE_ENGINE_STARTUP_TIMEOUT: how long to wait for engine cores to report READY."""
    return float(envs.get("KVSERVE_ENGINE_STARTUP_TIMEOUT"))


class EngineAddresses(msgspec.Struct):
    """Every address of one DP group (or one engine): the front binds them all."""
    handshake: str
    inputs: list[str]           # one per API server (client)
    outputs: list[str]
    coordinator_input: Optional[str] = None
    coordinator_engines: Optional[str] = None
    coordinator_frontend: Optional[str] = None

    def for_engines(self) -> EngineZmqAddresses:
        return EngineZmqAddresses(inputs=list(self.inputs), outputs=list(self.outputs))


class ClientAddresses(msgspec.Struct):
    """What one API server (client) binds, and where it hears the coordinator's counts."""
    input: str
    output: str
    coordinator_frontend: Optional[str] = None
    client_index: int = 0


def client_addresses(addresses: EngineAddresses, index: int) -> ClientAddresses:
    return ClientAddresses(addresses.inputs[index], addresses.outputs[index],
                           addresses.coordinator_frontend, index)


def free_tcp_address(host: str) -> str:
    """`tcp://host:port` with a port free right now (the binder takes it moments later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return tcp_address(host, port)


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def make_engine_addresses(pc: ParallelConfig, ipc_dir: str, num_clients: int = 1) -> EngineAddresses:
    if pc.has_remote_engines:
        host = pc.data_parallel_address
        assert host is not None
        handshake = tcp_address(host, pc.data_parallel_rpc_port)

        def new(_: str) -> str:
            return free_tcp_address(host)
    else:
        handshake = f"ipc://{os.path.join(ipc_dir, 'handshake')}"

        def new(name: str) -> str:
            return f"ipc://{os.path.join(ipc_dir, name)}"
    dp = pc.data_parallel_size > 1
    return EngineAddresses(
        handshake=handshake,
        inputs=[new(f"input{i}") for i in range(num_clients)],
        outputs=[new(f"output{i}") for i in range(num_clients)],
        coordinator_input=new("coord_in") if dp else None,
        coordinator_engines=new("coord_eng") if dp else None,
        coordinator_frontend=new("coord_fe") if dp else None)


class CoreEngineProcManager:
    """This node's engine core processes (one per local DP rank)."""

    def __init__(self, pc: ParallelConfig, handshake_address: str,
                 config: Optional[KVServeConfig] = None) -> None:
        """`config` for a headless node's engines (they build nothing from the front's)."""
        root = logging.getLogger()
        self.procs: dict[int, multiprocessing.process.BaseProcess] = {}
        first = pc.data_parallel_start_rank if pc.data_parallel_size > 1 else 0
        for index in range(first, first + pc.local_engine_count):
            proc = multiprocessing.get_context("spawn").Process(
                target=run_engine_core, name=f"EngineCore_{index}",
                kwargs=dict(handshake_address=handshake_address, engine_index=index,
                            data_parallel=pc.data_parallel_size > 1, config=config,
                            # The child configures logging like ours, if ours is set up.
                            log_level=(logging.getLogger("kvserve").getEffectiveLevel()
                                       if root.handlers else None)))
            proc.start()
            self.procs[index] = proc


def launch_core_engines(config: KVServeConfig, resources: Any,
                        addresses: EngineAddresses, sync_ctx: zmq.Context) -> None:
    """The front node: DP store and coordinator, this node's engines, and the handshake with
    all `data_parallel_size` engines. Fills `resources` (procs, coordinator, store) as it goes,
    so that a failure half-way is cleaned up by `resources.close()`."""
    pc = config.parallel_config
    handshake = sync_ctx.socket(zmq.ROUTER)
    try:
        try:
            handshake.bind(addresses.handshake)
        except zmq.ZMQError as e:
            raise ValueError(f"Cannot listen for the engines' handshake on "
                             f"{addresses.handshake}: {e} (--data-parallel-address / "
                             f"--data-parallel-rpc-port).") from e
        if pc.data_parallel_size > 1:
            _start_dp_coordinator(config, resources, addresses)
        resources.procs = CoreEngineProcManager(pc, addresses.handshake).procs
        resources.proc = next(iter(resources.procs.values()), None)
        _wait_for_engine_startup(handshake, config, resources.procs, addresses)
    finally:
        handshake.close(linger=0)


def _start_dp_coordinator(config: KVServeConfig, resources: Any,
                          addresses: EngineAddresses) -> None:
    """Data parallelism: the coordinator process and the DP group's rendezvous store."""
    import torch.distributed as dist

    from kvserve.engine.coordinator import DPCoordinator
    pc = config.parallel_config
    if pc.has_remote_engines:
        assert pc.data_parallel_address is not None
        pc.data_parallel_master_addr = pc.data_parallel_address
    resources.dp_store = dist.TCPStore(pc.data_parallel_master_addr, 0, is_master=True,
                                       wait_for_workers=False)
    pc.data_parallel_master_port = resources.dp_store.port
    resources.coordinator = DPCoordinator(pc.data_parallel_size, addresses.coordinator_input,
                                          addresses.coordinator_engines,
                                          addresses.coordinator_frontend)
    pc.dp_coordinator_input = addresses.coordinator_input
    pc.dp_coordinator_engines = addresses.coordinator_engines


def _wait_for_engine_startup(handshake: zmq.Socket, config: KVServeConfig,
                             procs: dict[int, multiprocessing.process.BaseProcess],
                             addresses: EngineAddresses) -> None:
    """Per engine: HELLO -> init -> READY (or FAILED: raise the engine's error). Remote
    engines must say HELLO within dp_handshake_timeout_s(); READY may take the model load."""
    pc = config.parallel_config
    expected = {engine_identity(i): i for i in range(pc.data_parallel_size)}
    local = {engine_identity(i) for i in procs}
    hello: set[bytes] = set()
    ready: set[bytes] = set()
    started = time.monotonic()
    while len(ready) < len(expected):
        missing = [expected[i] for i in expected if i not in hello and i not in local]
        if missing:
            deadline, what = started + dp_handshake_timeout_s(), _missing_message(missing, addresses)
        else:
            deadline, what = started + startup_timeout_s(), "no READY from every engine"
        identity, msg = recv_during_startup(handshake, list(procs.values()), deadline, what)
        status = msgspec.msgpack.decode(msg)
        kind = status.get("status")
        if kind == "HELLO":
            problem = _check_hello(identity, status, expected, local, hello, pc)
            if problem is not None:
                handshake.send_multipart([identity, msgspec.msgpack.encode(
                    EngineHandshakeMetadata(addresses=addresses.for_engines(), error=problem))])
                raise ValueError(problem)
            hello.add(identity)
            handshake.send_multipart([identity, msgspec.msgpack.encode(
                _init_message(config, addresses, headless=bool(status.get("headless"))))])
        elif kind == "READY":
            config.cache_config.num_blocks = int(status["num_gpu_blocks"])
            ready.add(identity)
        elif kind == "FAILED":
            raise startup_error(status)
        else:
            raise RuntimeError(f"Unexpected handshake message from the engine core: {status!r}")


def _missing_message(missing: list[int], addresses: EngineAddresses) -> str:
    return (f"engine(s) with DP rank {missing} did not connect to "
            f"{addresses.handshake}; start them on their node with `kvserve serve MODEL "
            f"--headless --data-parallel-start-rank R --data-parallel-address ... "
            f"--data-parallel-rpc-port ...` (KVSERVE_DP_HANDSHAKE_TIMEOUT)")


def _check_hello(identity: bytes, status: dict, expected: dict[bytes, int], local: set[bytes],
                 hello: set[bytes], pc: ParallelConfig) -> Optional[str]:
    """Why this engine cannot join the group (None: it can)."""
    if identity not in expected:
        return (f"An engine with DP rank {int.from_bytes(identity, 'little')} connected, but "
                f"data_parallel_size is {pc.data_parallel_size}.")
    rank = expected[identity]
    if identity in hello or (status.get("headless") and identity in local):
        return (f"Two engines with DP rank {rank} connected (check --data-parallel-start-rank "
                f"and --data-parallel-size-local on every node).")
    if status.get("headless") and status.get("data_parallel_size") != pc.data_parallel_size:
        return (f"The engine with DP rank {rank} has data_parallel_size "
                f"{status.get('data_parallel_size')}, the front node {pc.data_parallel_size}.")
    return None


def _init_message(config: KVServeConfig, addresses: EngineAddresses,
                  headless: bool) -> EngineHandshakeMetadata:
    engine_addresses = addresses.for_engines()
    if not headless:
        return EngineHandshakeMetadata(addresses=engine_addresses, config=pickle.dumps(config))
    pc = config.parallel_config
    return EngineHandshakeMetadata(addresses=engine_addresses,
                                   parallel_config={k: getattr(pc, k) for k in _DP_INIT_FIELDS})


def recv_during_startup(sock: zmq.Socket, procs: list[multiprocessing.process.BaseProcess],
                        deadline: float, what: str, copy: bool = True) -> list[Any]:
    """Wait for a message, but not for a process that has died or past `deadline`."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    for proc in procs:
        poller.register(proc.sentinel, zmq.POLLIN)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"The engine cores did not complete their start-up in time: "
                               f"{what} (KVSERVE_ENGINE_STARTUP_TIMEOUT="
                               f"{startup_timeout_s():.0f} s, KVSERVE_DP_HANDSHAKE_TIMEOUT="
                               f"{dp_handshake_timeout_s():.0f} s).")
        events = dict(poller.poll(timeout=remaining * 1000))
        if sock in events:
            return sock.recv_multipart(copy=copy)
        dead = [p for p in procs if p.sentinel in events]
        if dead:
            proc = dead[0]
            # Its last message may still be on the way.
            if sock.poll(timeout=500):
                return sock.recv_multipart(copy=copy)
            proc.join(1.0)
            raise RuntimeError(
                f"The engine core process died during start-up ({what}), exit code "
                f"{proc.exitcode}. See its log above. It is started with the 'spawn' method, "
                f"which re-imports the main script: a script that creates an engine at "
                f"import time needs an `if __name__ == '__main__':` guard.")


def startup_error(status: dict) -> Exception:
    """The engine's start-up error, as the same builtin type where there is one (so that e.g.
    a KV cache too small for max_model_len is a ValueError with or without multiprocessing),
    with the engine's traceback in the message."""
    import builtins
    name = str(status.get("error_type", "RuntimeError"))
    message = (f"Engine core initialization failed: {name}: {status.get('error', '')}\n"
               f"Engine core traceback:\n{status.get('traceback', '')}")
    exc_type = getattr(builtins, name, None)
    if (isinstance(exc_type, type) and issubclass(exc_type, Exception)
            and not issubclass(exc_type, KeyError)):     # KeyError would quote the message
        try:
            return exc_type(message)
        except Exception:      # a type that wants other arguments
            pass
    return RuntimeError(message)


def wait_for_processes(procs: list[multiprocessing.process.BaseProcess]) -> int:
    """Until one of `procs` exits or SIGTERM / SIGINT arrives; then stop them all. Returns 0
    for a signal or clean exits, 1 when a process failed."""
    import signal

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, on_signal)
    exit_code = 0
    try:
        for sentinel in multiprocessing.connection.wait([p.sentinel for p in procs]):
            next(p for p in procs if p.sentinel == sentinel).join(5.0)      # reap: exitcode
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        if failed:
            logger.error("%s exited with code %s; stopping the others.", failed[0].name,
                         failed[0].exitcode)
            exit_code = 1
    except (SystemExit, KeyboardInterrupt):
        logger.info("Shutting down.")
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
    return exit_code


def run_headless(config: KVServeConfig) -> int:
    """A `--headless` node: its engines connect to the front node and serve its requests;
    no API server here. Returns when an engine exits (the front went away, or it failed)
    or on SIGTERM / SIGINT."""
    pc = config.parallel_config
    if not pc.data_parallel_address:
        raise ValueError("--headless needs --data-parallel-address: the front node's address "
                         "(where `kvserve serve` without --headless runs) to connect to.")
    if pc.local_engine_count < 1:
        raise ValueError("--headless with --data-parallel-size-local 0 has no engine to run.")
    handshake = tcp_address(pc.data_parallel_address, pc.data_parallel_rpc_port)
    manager = CoreEngineProcManager(pc, handshake, config=config)
    logger.info("Headless node: engines with DP ranks %s connect to the front node at %s.",
                sorted(manager.procs), handshake)
    return wait_for_processes(list(manager.procs.values()))
