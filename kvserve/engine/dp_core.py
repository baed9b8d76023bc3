"""DPEngineCoreProc: one engine core of a data-parallel group, stepping in waves.

Engines of a DP group step together in *waves* (seed 001). A wave starts when any engine gets
work while the group is idle: it asks the coordinator to wake the others (START_DP_WAVE).
Within a wave every engine steps; one with nothing to run takes a dummy step. Every
`_ALL_REDUCE_EVERY` steps the engines all-reduce "do I have unfinished requests"; when no
engine has any, the wave ends on all of them at the same step, and the wave number goes up.

Expert-parallel models need this lock-step (their layers hold collectives across the DP
group). Dense models do not, so it is kept cheap for them: the dummy step is a short pause
(no forward pass), and the all-reduce is one tiny gloo call every 32 steps.

A peer that dies breaks the group: the survivors log it and go on alone (no all-reduce), so
their requests are not lost.
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading
from typing import Any, Optional

import msgspec
import torch
import torch.distributed as dist
import zmq

from kvserve.core.messages import EngineCoreRequestType
from kvserve.engine.core_proc import EngineCoreProc

logger = logging.getLogger(__name__)

_ALL_REDUCE_EVERY = 32
# A dummy step (an engine with no requests inside a wave) pauses this long for new input
# instead of running the model: dense models need no forward to stay in step.
_DUMMY_STEP_S = 0.002
_DP_GROUP_TIMEOUT = datetime.timedelta(seconds=600)


class DPEngineCoreProc(EngineCoreProc):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pc = self.config.parallel_config
        self.dp_rank, self.dp_size = self.engine_index, pc.data_parallel_size
        self.step_counter = 0
        self.current_wave = 0
        self.engines_running = False
        self._wave_requested = -1
        self._last_counts: Optional[tuple[int, int]] = None
        store = dist.TCPStore(pc.data_parallel_master_addr, pc.data_parallel_master_port,
                              is_master=False, timeout=_DP_GROUP_TIMEOUT)
        self.dp_group: Optional[dist.ProcessGroup] = dist.ProcessGroupGloo(
            dist.PrefixStore("dp_group", store), self.dp_rank, self.dp_size, _DP_GROUP_TIMEOUT)
        self._zmq = zmq.Context()
        self._to_coordinator = self._zmq.socket(zmq.PUSH)
        self._to_coordinator.connect(pc.dp_coordinator_input)
        threading.Thread(target=self._coordinator_reader, args=(pc.dp_coordinator_engines,),
                         daemon=True, name="DPCoordinatorReader").start()

    # ------------------------------------------------------------------ coordinator
    def _coordinator_reader(self, address: str) -> None:
        """Thread: START_DP_WAVE from the coordinator -> input_queue (wakes an idle loop)."""
        sock = self._zmq.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        try:
            while True:
                _, wave = sock.recv_multipart()
                self.input_queue.put_nowait((EngineCoreRequestType.START_DP_WAVE,
                                             msgspec.msgpack.decode(wave)))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _send_to_coordinator(self, msg: dict) -> None:
        self._to_coordinator.send(msgspec.msgpack.encode(msg))

    def _maybe_publish_request_counts(self) -> None:
        counts = (self.scheduler.num_waiting_reqs, len(self.scheduler.running))
        if counts != self._last_counts:
            self._last_counts = counts
            self._send_to_coordinator({"engine": self.dp_rank, "waiting": counts[0],
                                       "running": counts[1]})

    # ------------------------------------------------------------------ requests
    def _handle_client_request(self, request_type: Any, request: Any) -> None:
        if request_type == EngineCoreRequestType.START_DP_WAVE:
            wave = int(request)
            if not self.engines_running and wave >= self.current_wave:
                self.current_wave, self.engines_running = wave, True
            else:
                self._wave_requested = max(self._wave_requested, wave)
            return
        super()._handle_client_request(request_type, request)
        if request_type == EngineCoreRequestType.ADD and not self.engines_running:
            # Work while the group is idle: this engine starts the next wave for everyone.
            self.engines_running = True
            self._send_to_coordinator({"start_wave": self.current_wave})

    def _process_input_queue(self) -> None:
        """Block only while this engine has nothing to do *and* the group is idle."""
        while not self.scheduler.has_unfinished_requests() and not self.engines_running:
            self._handle_client_request(*self.input_queue.get())
        while True:
            try:
                request = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_client_request(*request)

    # ------------------------------------------------------------------ busy loop
    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            local_unfinished = self.scheduler.has_unfinished_requests()
            if local_unfinished:
                self._process_engine_step()
            self._maybe_publish_request_counts()
            if not local_unfinished:
                self.execute_dummy_batch()
            self.engines_running = self._has_global_unfinished_reqs(
                self.scheduler.has_unfinished_requests())
            if not self.engines_running:
                logger.debug("DP engine %d: wave %d finished", self.dp_rank, self.current_wave)
                self.current_wave += 1
                self.step_counter = 0
                if self._wave_requested >= self.current_wave:
                    self.engines_running = True

    def execute_dummy_batch(self) -> None:
        """A step with nothing to run inside a wave: wait briefly for input (dense models
        need no forward pass to keep the group in step)."""
        try:
            request = self.input_queue.get(timeout=_DUMMY_STEP_S)
        except queue.Empty:
            return
        self._handle_client_request(*request)

    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        self.step_counter += 1
        if self.dp_group is None:
            return local_unfinished
        if self.step_counter % _ALL_REDUCE_EVERY != 0:
            return True
        flag = torch.tensor([int(local_unfinished)], dtype=torch.int32)
        try:
            self.dp_group.allreduce([flag]).wait()
        except Exception as e:
            logger.error("DP engine %d: the DP group is broken (%s: %s); a peer engine died. "
                         "Continuing alone.", self.dp_rank, type(e).__name__, e)
            self.dp_group = None
            return local_unfinished
        return bool(flag.item())

    def shutdown(self) -> None:
        try:
            self._to_coordinator.close(linger=0)
            self._zmq.term()
        finally:
            super().shutdown()
