"""IPC benchmarks for the multiprocess engine.

Section "ipc_round_trip": round-trip latency of a small execute_model-sized
message (a dict of a few lists of ~64 ints and strings) between this process and
one echo process, through
  - MessageQueue (shared-memory ring; requests on one queue, replies on a second),
  - ZMQ PAIR over ipc:// (one socket, both directions),
  - ZMQ PUSH/PULL over ipc:// (one socket pair per direction),
  - multiprocessing.Queue (one per direction).
Every transport pickles the same objects with protocol 5, so the rows differ only
in the transport. One run; median and p99 in microseconds.

    python benchmarks/ipc.py [--iters 3000] [--output-json out.json]

Absolute times on shared machines drift; compare rows of one run.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import platform
import tempfile
import time
import uuid
from typing import Any, Callable

import numpy as np
import zmq

from kvserve.distributed.shm_broadcast import MessageQueue

CTX = mp.get_context("spawn")
N_REQS = 64


def make_message(step: int) -> dict[str, Any]:
    """About what the engine core broadcasts per decode step for a 64-request batch."""
    return {
        "method": "execute_model",
        "step": step,
        "req_ids": [f"req-{i:06d}" for i in range(N_REQS)],
        "num_scheduled_tokens": [1] * N_REQS,
        "new_token_ids": list(range(1000 + step, 1000 + step + N_REQS)),
        "num_computed_tokens": [128 + step] * N_REQS,
        "finished_req_ids": [],
    }


def make_reply(msg: dict[str, Any]) -> dict[str, Any]:
    """About what rank 0 answers: the req ids and one sampled token each."""
    return {"req_ids": msg["req_ids"], "sampled_token_ids": msg["new_token_ids"]}


# ---- echo processes: receive, build the reply, send it back; None stops ----------------

def _echo_mq(req_handle: Any, conn: Any) -> None:
    req = MessageQueue.create_from_handle(req_handle, 0)
    resp = MessageQueue(1, 1)
    conn.send(resp.export_handle())
    req.wait_until_ready(timeout=60)
    resp.wait_until_ready(timeout=60)
    while (msg := req.dequeue()) is not None:
        resp.enqueue(make_reply(msg))
    req.close()
    resp.close()


def _echo_zmq(kind: str, addrs: list[str]) -> None:
    ctx = zmq.Context()
    if kind == "pair":
        rx = tx = ctx.socket(zmq.PAIR)
        rx.connect(addrs[0])
    else:
        rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        rx.connect(addrs[0])
        tx.connect(addrs[1])
    while (msg := pickle.loads(rx.recv())) is not None:
        tx.send(pickle.dumps(make_reply(msg), protocol=5))
    ctx.destroy(linger=0)


def _echo_mp_queue(req_q: Any, resp_q: Any) -> None:
    while (msg := req_q.get()) is not None:
        resp_q.put(make_reply(msg))


# ---- timing -------------------------------------------------------------------------------

def _time_round_trips(send: Callable[[Any], None], recv: Callable[[], Any],
                      iters: int, warmup: int) -> dict[str, float]:
    msgs = [make_message(i) for i in range(iters + warmup)]
    times = np.empty(iters)
    for i, msg in enumerate(msgs):
        t0 = time.perf_counter()
        send(msg)
        reply = recv()
        dt = time.perf_counter() - t0
        assert reply["sampled_token_ids"][0] == msg["new_token_ids"][0]
        if i >= warmup:
            times[i - warmup] = dt
    us = times * 1e6
    return {"median_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "iters": iters}


def _finish(proc: Any) -> None:
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
        proc.join()


def bench_message_queue(iters: int, warmup: int) -> dict[str, float]:
    req = MessageQueue(1, 1)
    parent_conn, child_conn = CTX.Pipe()
    proc = CTX.Process(target=_echo_mq, args=(req.export_handle(), child_conn), daemon=True)
    proc.start()
    resp = None
    try:
        resp = MessageQueue.create_from_handle(parent_conn.recv(), 0)
        req.wait_until_ready(timeout=60)
        resp.wait_until_ready(timeout=60)
        result = _time_round_trips(lambda m: req.enqueue(m), lambda: resp.dequeue(timeout=10),
                                   iters, warmup)
        req.enqueue(None)
        return result
    finally:
        _finish(proc)
        req.close()
        if resp is not None:
            resp.close()


def bench_zmq(kind: str, iters: int, warmup: int) -> dict[str, float]:
    tmp = tempfile.gettempdir()
    addrs = [f"ipc://{tmp}/kvserve-bench-{uuid.uuid4().hex}" for _ in range(2)]
    ctx = zmq.Context()
    if kind == "pair":
        tx = rx = ctx.socket(zmq.PAIR)
        tx.bind(addrs[0])
    else:
        tx, rx = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        tx.bind(addrs[0])
        rx.bind(addrs[1])
    proc = CTX.Process(target=_echo_zmq, args=(kind, addrs), daemon=True)
    proc.start()
    try:
        result = _time_round_trips(lambda m: tx.send(pickle.dumps(m, protocol=5)),
                                   lambda: pickle.loads(rx.recv()), iters, warmup)
        tx.send(pickle.dumps(None))
        return result
    finally:
        _finish(proc)
        ctx.destroy(linger=0)


def bench_mp_queue(iters: int, warmup: int) -> dict[str, float]:
    req_q, resp_q = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_echo_mp_queue, args=(req_q, resp_q), daemon=True)
    proc.start()
    try:
        result = _time_round_trips(req_q.put, lambda: resp_q.get(timeout=10), iters, warmup)
        req_q.put(None)
        return result
    finally:
        _finish(proc)


def section_ipc_round_trip(args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = [
        ("MessageQueue (shm ring)", lambda: bench_message_queue(args.iters, args.warmup)),
        ("ZMQ PAIR ipc://", lambda: bench_zmq("pair", args.iters, args.warmup)),
        ("ZMQ PUSH/PULL ipc://", lambda: bench_zmq("pushpull", args.iters, args.warmup)),
        ("multiprocessing.Queue", lambda: bench_mp_queue(args.iters, args.warmup)),
    ]
    rows = []
    for name, run in runs:
        rows.append({"transport": name, **run()})
    msg_bytes = len(pickle.dumps(make_message(0), protocol=5))
    print(f"\nRound trip of an execute_model-sized message ({msg_bytes} B pickled), "
          f"{args.iters} iterations, one run")
    print(f"{'transport':<26} {'median us':>10} {'p99 us':>10} {'mean us':>10}")
    for r in rows:
        print(f"{r['transport']:<26} {r['median_us']:>10.1f} {r['p99_us']:>10.1f} {r['mean_us']:>10.1f}")
    return rows


# Each section takes the parsed args, prints its table and returns JSON-able rows.
SECTIONS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "ipc_round_trip": section_ipc_round_trip,
    # Next section (added by the lead): per-step overhead of the multiprocess engine
    # against the in-process one on the same workload.
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "args": vars(args),
    }
    for name in args.sections:
        results[name] = SECTIONS[name](args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.output_json}")


if __name__ == "__main__":
    main()
