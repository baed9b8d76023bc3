"""The engine core's one output thread serving several API servers (`--api-server-count N`),
one of which died: its socket is never read again, so once its queue is full a send to it
would block. Told to shut down, the thread must not stay blocked on it (it used to, for
ever: the engine's exit then waited on the join timeout and interpreter finalisation), and
the live server's outputs queued before the stop are still delivered.

Real zmq sockets and EngineCoreProc's own output thread (process_output_sockets); the engine
(model, executor) is not needed for it, so the object is built without its __init__.
"""
from __future__ import annotations

import queue
import threading
import time

import pytest
import zmq

from kvserve.core.messages import EngineCoreOutput, EngineCoreOutputs
from kvserve.engine.core_proc import EngineCoreProc
from kvserve.engine.serial_utils import MsgpackDecoder

pytestmark = pytest.mark.timeout(60)


def _outputs(i: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=f"r{i}", new_token_ids=[i])])


def test_output_thread_not_blocked_by_dead_api_server(tmp_path) -> None:
    ctx = zmq.Context()
    live = ctx.socket(zmq.PULL)
    live_addr, dead_addr = f"ipc://{tmp_path}/live", f"ipc://{tmp_path}/dead"
    live.bind(live_addr)
    # The dead server's address: nothing binds it (its process is gone), so what is sent to
    # it queues on our side until the high-water mark, then a send would block.
    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.input_queue, engine.output_queue = queue.Queue(), queue.Queue()
    engine._output_linger_ms, engine._output_deadline = 0, None
    engine.output_thread = threading.Thread(target=engine.process_output_sockets,
                                            args=([live_addr, dead_addr],), daemon=True)
    engine.output_thread.start()
    try:
        for i in range(3):
            engine.output_queue.put_nowait((0, _outputs(i)))
        for i in range(3000):       # well past zmq's default SNDHWM of 1000
            engine.output_queue.put_nowait((1, _outputs(i)))
        decoder = MsgpackDecoder(EngineCoreOutputs)
        got = []
        for _ in range(3):
            assert live.poll(10_000), "the live API server got nothing"
            got.append(decoder.decode(live.recv_multipart()).outputs[0].request_id)
        assert got == ["r0", "r1", "r2"]
        time.sleep(0.5)
        assert engine.output_thread.is_alive()     # blocked on the dead server (or waiting)
        t0 = time.monotonic()
        engine.shutdown_output_thread()
        took = time.monotonic() - t0
        assert not engine.output_thread.is_alive(), "the output thread is still blocked"
        assert took < 2.0, took
        assert engine.input_queue.empty()          # it stopped cleanly, no IO-thread failure
    finally:
        live.close(linger=0)
        ctx.term()
