"""DPCoordinator: one process beside the data-parallel engine cores.

    engines ── PUSH {"engine", "waiting", "running"} / {"start_wave"} ──► coordinator PULL
    coordinator PUB ── [b"counts", [[waiting, running], ...]] ──► frontends (load balancing)
    coordinator PUB ── [START_DP_WAVE, wave] ──► engines (an idle engine joins the wave)

It owns no model and no request: it only relays queue lengths (published at most every
`_PUBLISH_INTERVAL_S`, and only when they changed) and wave starts. An engine that gets work
while the DP group is idle starts the next wave and asks the coordinator to wake the others,
so every engine steps (dummy batches when it has nothing) until the all-reduce says the whole
group is done.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from typing import Any, Optional

import msgspec
import zmq

logger = logging.getLogger(__name__)

_PUBLISH_INTERVAL_S = 0.05
COUNTS_TOPIC = b"counts"


def run_coordinator(num_engines: int, input_address: str, engines_address: str,
                    frontend_address: str, parent_pid: int) -> None:
    """Process entry point; exits on SIGTERM or when its parent (the frontend) is gone."""
    from kvserve.executor.multiproc import _set_process_name
    _set_process_name("KVSDPCoord")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(input_address)
    to_engines = ctx.socket(zmq.PUB)
    to_engines.bind(engines_address)
    to_frontend = ctx.socket(zmq.PUB)
    to_frontend.bind(frontend_address)
    counts = [[0, 0] for _ in range(num_engines)]
    published: Optional[list[list[int]]] = None
    last_publish = 0.0
    try:
        while os.getppid() == parent_pid:
            if pull.poll(timeout=int(_PUBLISH_INTERVAL_S * 1000)):
                msg: dict[str, Any] = msgspec.msgpack.decode(pull.recv())
                if "start_wave" in msg:
                    # Relay to every engine; the sender ignores its own (already running).
                    to_engines.send_multipart([b"\x04", msgspec.msgpack.encode(msg["start_wave"])])
                else:
                    counts[msg["engine"]] = [msg["waiting"], msg["running"]]
            now = time.monotonic()
            if counts != published and now - last_publish >= _PUBLISH_INTERVAL_S:
                to_frontend.send_multipart([COUNTS_TOPIC, msgspec.msgpack.encode(counts)])
                published, last_publish = [list(c) for c in counts], now
    finally:
        for sock in (pull, to_engines, to_frontend):
            sock.close(linger=0)
        ctx.term()


class DPCoordinator:
    """The frontend's handle on the coordinator process (which binds the three addresses)."""

    def __init__(self, num_engines: int, input_address: str, engines_address: str,
                 frontend_address: str) -> None:
        self.input_address = input_address
        self.engines_address = engines_address
        self.frontend_address = frontend_address
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_coordinator, name="DPCoordinator", daemon=True,
            kwargs=dict(num_engines=num_engines, input_address=self.input_address,
                        engines_address=self.engines_address,
                        frontend_address=self.frontend_address, parent_pid=os.getpid()))
        self.proc.start()

    def shutdown(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
