"""`kvserve serve --api-server-count N`: N API server processes on one port.

    launcher (this process)         binds N listening sockets on the port (SO_REUSEPORT: the
                                    kernel spreads connections over them), starts the engine
                                    core(s) (and the DP coordinator) and runs their handshake
    APIServer_0 .. APIServer_{N-1}  each: its own socket, its own AsyncLLM client with its own
                                    input/output sockets that every engine connects to

Each engine routes a request's outputs to the API server that sent it (EngineCoreRequest.
client_index) and sends its scheduler stats to all. Metrics use prometheus_client's
multiprocess mode (metrics/prometheus.py), so /metrics on any server shows the totals of all.
Each server's access log lines carry its process name (`[APIServer_i]`).

The launcher exits when an API server exits (stopping the rest and the engines), or on
SIGTERM / SIGINT, which it passes on to the API servers (graceful) and then the engines.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import multiprocessing
import os
import shutil
import socket
import tempfile

from kvserve.config import KVServeConfig
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.launch import (ClientAddresses, client_addresses, launch_core_engines,
                                   make_engine_addresses, wait_for_processes)
from kvserve.utils.memory import configure_process_memory

logger = logging.getLogger("kvserve.entrypoints.openai.multi_server")


def run_api_servers(args: argparse.Namespace) -> int:
    import zmq

    from kvserve.engine.mp_client import BackgroundResources, _make_ipc_dir
    from kvserve.entrypoints.openai.api_server import _bind_socket
    from kvserve.entrypoints.openai.serving_chat import load_chat_template

    n = args.api_server_count
    if args.chat_template is not None:
        load_chat_template(args.chat_template)   # a bad path fails before the model loads
    socks = [_bind_socket(args.host, args.port, reuse_port=True) for _ in range(n)]
    config = EngineArgs.from_cli_args(args).create_engine_config()
    prom_dir = tempfile.mkdtemp(prefix="kvserve-prometheus-")
    # Before the API servers start (and import prometheus_client).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
    resources = BackgroundResources()
    resources.num_engines = config.parallel_config.data_parallel_size
    try:
        resources.ipc_dir = _make_ipc_dir()
        resources.ctx = zmq.Context()
        addresses = make_engine_addresses(config.parallel_config, resources.ipc_dir, n)
        launch_core_engines(config, resources, addresses, resources.ctx)
        servers = []
        for i in range(n):
            proc = multiprocessing.get_context("spawn").Process(
                target=run_api_server_worker, name=f"APIServer_{i}",
                args=(args, socks[i], config, client_addresses(addresses, i)))
            proc.start()
            servers.append(proc)
        for sock in socks:
            sock.close()          # the servers hold their copies
        logger.info("Started %d API servers on port %d.", n, args.port)
        # An engine's death is the API servers' business (503, or exit): wait on them.
        return wait_for_processes(servers)
    finally:
        for sock in socks:
            sock.close()
        resources.close()
        shutil.rmtree(prom_dir, ignore_errors=True)


def run_api_server_worker(args: argparse.Namespace, sock: socket.socket, config: KVServeConfig,
                          addresses: ClientAddresses) -> None:
    """Process entry point of one API server."""
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.entrypoints.openai.api_server import serve_http
    from kvserve.executor.multiproc import _set_process_name

    _set_process_name(f"KVSAPIServer{addresses.client_index}")
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s "
                        f"[APIServer_{addresses.client_index}] %(name)s: %(message)s")
    configure_process_memory(f"API server {addresses.client_index}")
    try:
        code = asyncio.run(serve_http(args, sock, lambda: AsyncLLM(config, None, addresses),
                                      log_config=_access_log_config()))
    except KeyboardInterrupt:
        code = 0
    raise SystemExit(code)


def _access_log_config() -> dict:
    """uvicorn's logging, with the process name in every line (which server served what)."""
    from uvicorn.config import LOGGING_CONFIG
    config = copy.deepcopy(LOGGING_CONFIG)
    for name in ("default", "access"):
        fmt = config["formatters"][name]["fmt"]
        config["formatters"][name]["fmt"] = fmt.replace("%(levelprefix)s",
                                                        "%(levelprefix)s [%(processName)s]", 1)
    return config
