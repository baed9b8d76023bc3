"""DPAsyncMPClient: AsyncLLM's client for several data-parallel engine cores.

Each request goes to the engine with the least `4 * waiting + running`: the counts the
DP coordinator last published, plus the requests this client sent since (so a burst does not
all land on the engine that looked idle). Aborts follow a request to its engine. When one
engine dies, the whole client is dead (vLLM's default): every request fails with
EngineDeadError and the API server exits non-zero. With keep_serving_on_engine_death()
(`--keep-alive-on-engine-death`) only the dead engine's requests fail, /health reports 503,
and the other engines keep serving theirs (new requests go only to live engines).
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import msgspec
import zmq
import zmq.asyncio

from kvserve.config import KVServeConfig
from kvserve.core.messages import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from kvserve.engine.coordinator import COUNTS_TOPIC
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.launch import ClientAddresses
from kvserve.engine.mp_client import AsyncMPClient


class FailedEngineRequests(msgspec.Struct):
    """Put on the outputs queue when an engine dies: its requests end with `error`."""
    engine_index: int
    request_ids: list[str]
    message: str


class DPAsyncMPClient(AsyncMPClient):
    def __init__(self, config: KVServeConfig, addresses: Optional[ClientAddresses] = None) -> None:
        n = config.parallel_config.data_parallel_size
        # [waiting, running] per engine, from the coordinator plus what we sent since.
        self.lb_counts = [[0, 0] for _ in range(n)]
        self.request_engine: dict[str, int] = {}
        self._stats_task: Optional[asyncio.Task] = None
        super().__init__(config, addresses)

    def keep_serving_on_engine_death(self) -> None:
        """When one engine dies, only its requests fail; the others keep serving. (Without
        this, the default, one engine's death is the client's: resources.mark_dead.)"""
        self.resources.on_engine_dead = self._on_engine_dead

    @property
    def dead_engines(self) -> set[int]:
        return self.resources.dead_engines

    # ------------------------------------------------------------------ load balancing
    def _ensure_output_task(self) -> None:
        super()._ensure_output_task()
        if self._stats_task is None:
            self._stats_task = asyncio.get_running_loop().create_task(
                self._read_counts(), name="DPCountsReader")

    async def _read_counts(self) -> None:
        r = self.resources
        assert r.ctx is not None and self.addresses.coordinator_frontend is not None
        sock = r.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, COUNTS_TOPIC)
        sock.connect(self.addresses.coordinator_frontend)
        r.sockets.append(sock)
        try:
            while True:
                _, payload = await sock.recv_multipart()
                self.lb_counts = [list(c) for c in msgspec.msgpack.decode(payload)]
        except (zmq.ZMQError, asyncio.CancelledError):
            return      # closed with the client

    def get_core_engine_for_request(self) -> int:
        live = [i for i in range(self.num_engines) if i not in self.dead_engines]
        if not live:
            raise self.resources.make_dead_error()
        best = min(live, key=lambda i: 4 * self.lb_counts[i][0] + self.lb_counts[i][1])
        self.lb_counts[best][0] += 1
        return best

    # ------------------------------------------------------------------ requests
    async def add_request_async(self, request: EngineCoreRequest) -> None:
        engine = self.get_core_engine_for_request()
        self.request_engine[request.request_id] = engine
        await self._send_async(EngineCoreRequestType.ADD, request, self.engine_identities[engine])

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if not request_ids or self.resources.engine_dead or self.resources.closed:
            return
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self.request_engine.pop(rid, None)
            if engine is not None and engine not in self.dead_engines:
                by_engine.setdefault(engine, []).append(rid)
        for engine, ids in by_engine.items():
            await self._send_async(EngineCoreRequestType.ABORT, ids, self.engine_identities[engine])

    async def get_output_async(self) -> Any:
        out = await super().get_output_async()
        if isinstance(out, EngineCoreOutputs):
            for o in out.outputs:
                if o.finished:
                    self.request_engine.pop(o.request_id, None)
        return out

    def _on_engine_dead(self, engine_index: int, message: str) -> None:
        """Monitor thread: hand the dead engine's requests to the output handler."""
        r = self.resources
        loop = r.loop
        if loop is None or loop.is_closed():
            return

        def deliver() -> None:
            ids = [rid for rid, e in self.request_engine.items() if e == engine_index]
            for rid in ids:
                del self.request_engine[rid]
            assert isinstance(r.outputs_queue, asyncio.Queue)
            r.outputs_queue.put_nowait(FailedEngineRequests(engine_index, ids, message))

        loop.call_soon_threadsafe(deliver)

    async def call_utility_all_async(self, method: str, *args: Any,
                                     timeout: float = 5.0) -> dict[int, Any]:
        """The call on every live engine at once; an engine that fails or does not answer
        within `timeout` (it may be dying) is left out."""
        live = [i for i in range(self.num_engines) if i not in self.dead_engines]
        results = await asyncio.gather(*(
            asyncio.wait_for(self.call_utility_async(method, *args, engine_index=i), timeout)
            for i in live), return_exceptions=True)
        return {i: r for i, r in zip(live, results) if not isinstance(r, BaseException)}

    async def check_health_async(self) -> None:
        if self.dead_engines:
            raise EngineDeadError(f"Data-parallel engine(s) {sorted(self.dead_engines)} died.")
