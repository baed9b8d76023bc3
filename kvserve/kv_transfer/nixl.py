"""NixlConnector: the decode instance READs the prompt's KV blocks straight from the prefill
instance's KV cache into its own, with NIXL (UCX backend; DRAM on CPU, VRAM on CUDA).

    prefill instance (kv_transfer_params.do_remote_decode)   decode instance (do_remote_prefill)
    ─ computes the prompt, finishes (max_tokens=1)
    ─ keeps the blocks, returns kv_transfer_params:
      remote_engine_id / remote_block_ids /      ──client──►  allocates its blocks, waits in
      remote_host / remote_port / remote_request_id           WAITING_FOR_REMOTE_KVS
                        side channel (ZMQ REP) ◄── handshake: agent metadata + KV layout (once
                                                              per remote engine)
                      registered KV cache tensors ◄══ READ ══ into its own blocks (one transfer
                                                              per request; notif = request id)
    ─ notif arrives: frees the blocks                         ─ done: computes the last prompt
      (or after abort_request_timeout_s)                        token, then decodes

Each instance registers its KV cache tensors once. A failed or timed-out READ (or handshake)
makes the decode instance compute the prompt itself.

What NIXL 1.5.1 (UCX, CPU memory, one host) does when the prefill instance goes away during a
READ (measured, see tests/kv_transfer/test_disagg_nixl.py): killed, `transfer()` or
`check_xfer_state()` raise nixlRemoteDisconnectError (NIXL_ERR_REMOTE_DISCONNECT) within tens
of ms; stopped (hung), the READ stays "PROC" for ever (its completion needs the peer). So every
NIXL call on a READ is guarded, and a READ not done within transfer_timeout_s is released and
falls back; an errored peer is forgotten (the next request to it handshakes again).

kv_connector_extra_config: abort_request_timeout_s (prefill: how long blocks wait for a read,
default 120), transfer_timeout_s (decode: per READ, default 30), handshake_timeout_s
(default 5).
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import msgspec
import torch
import zmq

from kvserve.core.request import RequestStatus
from kvserve.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvserve.kv_transfer.params import get_kv_transfer_params

if TYPE_CHECKING:
    from kvserve.config import KVServeConfig
    from kvserve.core.request import Request
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

_INSTALL_HINT = ("NixlConnector needs NIXL: pip install 'kvserve[pd]' (installs nixl-cu12, "
                 "which runs on CPU too).")


# NIXL's UCX progress thread waits on its workers' event fds with poll(), its timeout the
# agent's pthrDelay (microseconds, rounded up to ms). nixl_agent (1.5.1) always passes 0, so
# the thread spins: most of a core (67% seen) on an idle instance. A READ or a notification
# wakes the thread at once through the fd either way; the delay only bounds the periodic
# wake-up that some UCX transports need in corner cases (NIXL's own comment).
PROGRESS_THREAD_DELAY_US = 10_000


def import_nixl() -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) from nixl-cu12, or the `nixl` meta package."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config   # type: ignore[no-redef]
        except ImportError:
            raise ImportError(_INSTALL_HINT) from None
    return nixl_agent, nixl_agent_config


def make_nixl_agent(name: str) -> Any:
    """A UCX nixl_agent whose progress thread sleeps while idle (PROGRESS_THREAD_DELAY_US).
    nixl_agent has no parameter for the delay: its nixlAgentConfig is caught on the way to
    the binding's nixlAgent (while this call runs) and given one."""
    nixl_agent, nixl_agent_config = import_nixl()
    binding = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    make = getattr(binding, "nixlAgent", None)
    if make is None or not hasattr(getattr(binding, "nixlAgentConfig", None), "pthrDelay"):
        logger.warning("NixlConnector: this NIXL has no nixlBind.nixlAgent(config.pthrDelay); "
                       "its progress thread may spin while idle.")
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))

    def make_with_delay(agent_name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_THREAD_DELAY_US
        return make(agent_name, config)

    with _AGENT_LOCK:
        binding.nixlAgent = make_with_delay
        try:
            return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        finally:
            binding.nixlAgent = make


_AGENT_LOCK = threading.Lock()


@dataclass
class RecvReqMeta:
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: Optional[str]


@dataclass
class NixlConnectorMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, RecvReqMeta] = field(default_factory=dict)
    # Prefill side: finished requests whose blocks wait for a read (the worker starts their
    # abort_request_timeout_s clock when it sees them).
    reqs_to_send: list[str] = field(default_factory=list)


class _KVLayout(msgspec.Struct):
    """What the side channel tells a peer: enough to address any of our blocks."""
    engine_id: str
    agent_metadata: bytes
    num_layers: int
    num_blocks: int
    block_len: int          # bytes of one block of K (or V) in one layer
    dtype: str
    base_addrs: list[int]   # per layer: address of the K half; V follows num_blocks blocks later


@dataclass
class _RemoteEngine:
    agent_name: Any
    layout: _KVLayout
    dlist: Any


@dataclass
class _InFlightRead:
    handle: Any
    start: float
    deadline: float
    nbytes: int
    remote_engine_id: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NixlConnector(KVConnectorBase):
    def __init__(self, config: "KVServeConfig", role: KVConnectorRole) -> None:
        super().__init__(config, role)
        kc = self.kv_transfer_config
        self.engine_id: str = kc.engine_id or ""
        self.abort_timeout_s = float(kc.get_from_extra_config("abort_request_timeout_s", 120.0))
        self.transfer_timeout_s = float(kc.get_from_extra_config("transfer_timeout_s", 30.0))
        self.handshake_timeout_s = float(kc.get_from_extra_config("handshake_timeout_s", 5.0))
        # Scheduler side.
        self._reqs_to_recv: dict[str, RecvReqMeta] = {}
        self._reqs_to_send: list[str] = []
        # Worker side.
        self.agent: Any = None
        self._layout: Optional[_KVLayout] = None
        self._local_dlist: Any = None
        self._remotes: dict[str, _RemoteEngine] = {}
        self._reading: dict[str, _InFlightRead] = {}
        self._sending: dict[str, float] = {}          # request id -> expiry (monotonic)
        self._early_notifs: dict[str, float] = {}     # read before we heard of the request
        self._done_sending_now: set[str] = set()
        self._done_recving: set[str] = set()
        self._side_channel: Optional[threading.Thread] = None
        self._stop = threading.Event()

    @classmethod
    def check_config(cls, kv_config: "KVTransferConfig") -> None:
        try:
            import_nixl()
        except ImportError as e:
            raise ValueError(str(e)) from None
        for key in ("abort_request_timeout_s", "transfer_timeout_s", "handshake_timeout_s"):
            value = kv_config.get_from_extra_config(key, 1.0)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"NixlConnector: {key} must be a positive number, got {value!r}.")

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        kv = get_kv_transfer_params(request.sampling_params)
        if not kv or not kv.get("do_remote_prefill") or not self.kv_transfer_config.is_kv_consumer:
            return 0, False
        num_prompt_blocks = _cdiv(request.num_prompt_tokens, self.block_size)
        if len(kv["remote_block_ids"]) != num_prompt_blocks:
            logger.warning("Request %s: %d remote blocks for a %d-token prompt (block size %d "
                           "here); computing it locally.", request.request_id,
                           len(kv["remote_block_ids"]), request.num_prompt_tokens, self.block_size)
            return 0, False
        return max(0, request.num_prompt_tokens - num_computed_tokens), True

    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        kv = get_kv_transfer_params(request.sampling_params)
        if not kv or num_external_tokens <= 0:
            return
        start = request.num_computed_tokens // self.block_size   # local prefix hit blocks
        self._reqs_to_recv[request.request_id] = RecvReqMeta(
            local_block_ids=list(block_ids[start:]),
            remote_block_ids=list(kv["remote_block_ids"][start:len(block_ids)]),
            remote_engine_id=kv["remote_engine_id"], remote_host=kv["remote_host"],
            remote_port=int(kv["remote_port"]), remote_request_id=kv.get("remote_request_id"))
        # Read once: after a preemption the request recomputes locally.
        kv["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = NixlConnectorMetadata(reqs_to_recv=self._reqs_to_recv,
                                     reqs_to_send=self._reqs_to_send)
        self._reqs_to_recv, self._reqs_to_send = {}, []
        return meta

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        kv = get_kv_transfer_params(request.sampling_params)
        if (not kv or not kv.get("do_remote_decode") or not self.kv_transfer_config.is_kv_producer
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        blocks = block_ids[:_cdiv(request.num_prompt_tokens, self.block_size)]
        self._reqs_to_send.append(request.request_id)
        return True, dict(do_remote_decode=False, do_remote_prefill=True,
                          remote_engine_id=self.engine_id, remote_block_ids=blocks,
                          remote_host=self.kv_transfer_config.kv_ip,
                          remote_port=self.kv_transfer_config.kv_port,
                          remote_request_id=request.request_id)

    # ------------------------------------------------------------------ worker: set-up
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        first = kv_caches[0]
        assert first.is_contiguous() and first.shape[0] == 2
        self.mem_type = "VRAM" if first.is_cuda else "DRAM"
        self.dev_id = first.device.index or 0
        self.agent = make_nixl_agent(self.engine_id)
        self.agent.register_memory(self.agent.get_reg_descs(kv_caches, self.mem_type))
        num_blocks = first.shape[1]
        block_len = first[0, 0].numel() * first.element_size()
        self._layout = _KVLayout(
            engine_id=self.engine_id, agent_metadata=self.agent.get_agent_metadata(),
            num_layers=len(kv_caches), num_blocks=num_blocks, block_len=block_len,
            dtype=str(first.dtype), base_addrs=[kv.data_ptr() for kv in kv_caches])
        self._local_dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._block_descs(self._layout))
        if self.kv_transfer_config.is_kv_producer:
            self._start_side_channel()
        logger.info("NixlConnector: %d layers x %d blocks registered (%s); side channel %s:%s",
                    len(kv_caches), num_blocks, self.mem_type, self.kv_transfer_config.kv_ip,
                    self.kv_transfer_config.kv_port)

    def _block_descs(self, layout: _KVLayout) -> Any:
        """One descriptor per (layer, K/V, block), index (layer * 2 + kv) * num_blocks + block."""
        n, blen = layout.num_blocks, layout.block_len
        descs = [(base + (kv * n + b) * blen, blen, self.dev_id)
                 for base in layout.base_addrs for kv in (0, 1) for b in range(n)]
        return self.agent.get_xfer_descs(descs, self.mem_type)

    def _start_side_channel(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.REP)
        sock.bind(f"tcp://{self.kv_transfer_config.kv_ip}:{self.kv_transfer_config.kv_port}")
        payload = msgspec.msgpack.encode(self._layout)

        def serve() -> None:
            try:
                while not self._stop.is_set():
                    if sock.poll(100):
                        sock.recv()
                        sock.send(payload)
            finally:
                sock.close(linger=0)

        self._side_channel = threading.Thread(target=serve, daemon=True,
                                              name="NixlSideChannel")
        self._side_channel.start()

    def _handshake(self, meta: RecvReqMeta) -> _RemoteEngine:
        remote = self._remotes.get(meta.remote_engine_id)
        if remote is not None:
            return remote
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{meta.remote_host}:{meta.remote_port}")
            sock.send(b"layout")
            if not sock.poll(int(self.handshake_timeout_s * 1000)):
                raise TimeoutError(f"no answer from {meta.remote_host}:{meta.remote_port} within "
                                   f"{self.handshake_timeout_s} s")
            layout = msgspec.msgpack.decode(sock.recv(), type=_KVLayout)
        finally:
            sock.close()
        mine = self._layout
        assert mine is not None
        if (layout.engine_id != meta.remote_engine_id or layout.num_layers != mine.num_layers
                or layout.block_len != mine.block_len or layout.dtype != mine.dtype):
            raise ValueError(f"remote KV layout {layout.engine_id} {layout.num_layers} layers, "
                             f"{layout.block_len} B blocks, {layout.dtype} does not match ours "
                             f"{mine.num_layers} layers, {mine.block_len} B, {mine.dtype}")
        name = self.agent.add_remote_agent(layout.agent_metadata)
        remote = _RemoteEngine(name, layout, self.agent.prep_xfer_dlist(
            name, self._block_descs(layout)))
        self._remotes[meta.remote_engine_id] = remote
        return remote

    # ------------------------------------------------------------------ worker: per step
    def start_load_kv(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, NixlConnectorMetadata):
            return
        now = time.monotonic()
        for rid in meta.reqs_to_send:
            if self._early_notifs.pop(rid, None) is not None:
                self._done_sending_now.add(rid)
            else:
                self._sending[rid] = now + self.abort_timeout_s
        for rid, req in meta.reqs_to_recv.items():
            try:
                self._start_read(rid, req)
            except Exception as e:   # noqa: BLE001  (any failure: compute locally)
                logger.warning("Request %s: reading KV from %s failed (%s); computing it "
                               "locally.", rid, req.remote_engine_id, e)
                self._remotes.pop(req.remote_engine_id, None)
                self._failed_recving.add(rid)

    def _start_read(self, rid: str, req: RecvReqMeta) -> None:
        remote = self._handshake(req)
        mine = self._layout
        assert mine is not None
        n = len(req.local_block_ids)
        if len(req.remote_block_ids) != n:
            raise ValueError(f"{len(req.remote_block_ids)} remote blocks for {n} local ones")
        local_idx, remote_idx = [], []
        for layer in range(mine.num_layers):
            for kv in (0, 1):
                lo = (layer * 2 + kv) * mine.num_blocks
                ro = (layer * 2 + kv) * remote.layout.num_blocks
                local_idx.extend(lo + b for b in req.local_block_ids)
                remote_idx.extend(ro + b for b in req.remote_block_ids)
        notif = (req.remote_request_id or "").encode()
        handle = self.agent.make_prepped_xfer("READ", self._local_dlist, local_idx, remote.dlist,
                                              remote_idx, notif)
        now = time.monotonic()
        try:
            # Small READs may complete inside this call; a dead peer raises here.
            state = self.agent.transfer(handle)
            if state == "ERR":
                raise RuntimeError("transfer could not start")
        except Exception:
            self._release(handle)
            raise
        self._num_started += 1
        self._reading[rid] = _InFlightRead(handle, now, now + self.transfer_timeout_s,
                                           len(local_idx) * mine.block_len, req.remote_engine_id)

    def _release(self, handle: Any) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as e:   # noqa: BLE001  (NIXL could not cancel it: nothing more to do)
            logger.error("NixlConnector: releasing a transfer handle failed: %r", e)

    def num_in_flight(self) -> int:
        return len(self._reading)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.agent is None:
            return set(), set()
        return self._poll_sending(), self._poll_reading()

    def _poll_reading(self) -> set[str]:
        now = time.monotonic()
        for rid, read in list(self._reading.items()):
            try:
                state = self.agent.check_xfer_state(read.handle)
            except Exception as e:   # noqa: BLE001  (the peer died: NIXL_ERR_REMOTE_DISCONNECT)
                state = f"ERR ({type(e).__name__}: {e})"
            if state == "PROC" and now < read.deadline:
                continue
            del self._reading[rid]
            self._release(read.handle)
            if state == "DONE":
                self._done_recving.add(rid)
                self._record_transfer(read.nbytes, now - read.start)
                continue
            if state == "PROC":
                why = f"timed out after {self.transfer_timeout_s:g} s"
            else:
                # Handshake again next time: the peer may have restarted with new metadata.
                why = f"failed: {state}"
                self._remotes.pop(read.remote_engine_id, None)
            logger.warning("Request %s: KV read from %s %s; computing it locally.", rid,
                           read.remote_engine_id, why)
            self._failed_recving.add(rid)
        done = self._done_recving | self._failed_recving
        self._done_recving = set()
        return done

    def _poll_sending(self) -> set[str]:
        done, self._done_sending_now = set(self._done_sending_now), set()
        now = time.monotonic()
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                rid = msg.decode()
                if self._sending.pop(rid, None) is not None:
                    done.add(rid)
                elif rid:
                    self._early_notifs[rid] = now
        for rid, expiry in list(self._sending.items()):
            if now >= expiry:
                logger.warning("Request %s: its KV blocks were not read within %.0f s; freeing "
                               "them.", rid, self.abort_timeout_s)
                del self._sending[rid]
                done.add(rid)
        # Notifications for requests this engine never kept (aborted): forget them eventually.
        for rid, seen in list(self._early_notifs.items()):
            if now - seen > self.abort_timeout_s:
                del self._early_notifs[rid]
        return done

    def shutdown(self) -> None:
        self._stop.set()
        if self._side_channel is not None:
            self._side_channel.join(timeout=2)
        if self.agent is not None:
            for read in self._reading.values():
                self._release(read.handle)
            self._reading.clear()
