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

Section "engine_step_overhead": the same decode-heavy workload (--num-prompts
prompts x --max-tokens greedy tokens, ignore_eos, --model, default the demo model)
through LLM.generate with the worker in this process (uniproc) and in a worker
process (distributed_executor_backend="mp", TP=1), runs interleaved; per-step
time of each and the difference (us/step), plus the executor's share
(execute_model wall time per step), a bare collective_rpc round trip and an
execute_model round trip with nothing scheduled (the per-step IPC alone).

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


# ---- per-step overhead of the multiprocess executor ------------------------------------------

class _StepMeter:
    """Counts engine steps and times execute_model by wrapping two bound methods of one engine."""

    def __init__(self, llm: Any) -> None:
        core_client = llm.llm_engine.engine_core
        executor = core_client.engine_core.model_executor
        self.steps, self.execute_s = 0, 0.0
        get_output, execute_model = core_client.get_output, executor.execute_model

        def counted_get_output() -> Any:
            self.steps += 1
            return get_output()

        def timed_execute_model(scheduler_output: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return execute_model(scheduler_output)
            finally:
                self.execute_s += time.perf_counter() - t0

        core_client.get_output = counted_get_output
        executor.execute_model = timed_execute_model

    def reset(self) -> None:
        self.steps, self.execute_s = 0, 0.0


def _rpc_round_trip_us(llm: Any, iters: int, method: str, args: tuple = ()) -> float:
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        executor.collective_rpc(method, args, unique_reply_rank=0)
        times[i] = time.perf_counter() - t0
    return float(np.median(times) * 1e6)


def section_engine_step_overhead(args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvserve.core.sched_output import CachedRequestData, SchedulerOutput
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    import torch

    # Same thread count for the in-process model and the worker process (it reads
    # OMP_NUM_THREADS when torch starts); more threads than free cores makes OpenMP's
    # barriers, not the IPC, dominate a step on a shared machine.
    torch.set_num_threads(args.threads)
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    # The engine core stays in this process for both rows: only the executor differs.
    common = dict(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20,
                  multiprocessing=False, seed=0)
    engines: dict[str, Any] = {}
    try:
        engines["uniproc (worker in process)"] = LLM(
            args.model, distributed_executor_backend="uni", **common)
        engines["mp, TP=1 (worker process)"] = LLM(
            args.model, distributed_executor_backend="mp", **common)
        rng = np.random.default_rng(0)
        vocab = next(iter(engines.values())).llm_engine.config.model_config.vocab_size
        prompts = [rng.integers(5, min(vocab, 700), size=16).tolist()
                   for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        meters = {name: _StepMeter(llm) for name, llm in engines.items()}
        outputs: dict[str, Any] = {}
        for name, llm in engines.items():   # warm-up (first-call allocations, page faults)
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
        tokens = list(outputs.values())
        assert all(t == tokens[0] for t in tokens), "uniproc and mp produced different tokens"
        per_step: dict[str, list[float]] = {n: [] for n in engines}
        exec_per_step: dict[str, list[float]] = {n: [] for n in engines}
        steps: dict[str, int] = {}
        for _ in range(args.repeats):        # interleaved: drift on a shared machine hits both
            for name, llm in engines.items():
                meters[name].reset()
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                steps[name] = meters[name].steps
                per_step[name].append(dt / meters[name].steps * 1e6)
                exec_per_step[name].append(meters[name].execute_s / meters[name].steps * 1e6)
        rpc_us = {name: _rpc_round_trip_us(llm, 2000, "check_health")
                  for name, llm in engines.items()}
        # A step with nothing scheduled: the IPC and pickling of execute_model without the model.
        empty = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
                                num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                                finished_req_ids=set())
        empty_step_us = {name: _rpc_round_trip_us(llm, 2000, "execute_model", (empty,))
                         for name, llm in engines.items()}
    finally:
        for llm in engines.values():
            llm.shutdown()
        if old_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_omp
    rows = [{"engine": name, "steps": steps[name],
             "us_per_step": float(np.median(per_step[name])),
             "best_us_per_step": float(np.min(per_step[name])),
             "execute_model_us_per_step": float(np.median(exec_per_step[name])),
             "collective_rpc_round_trip_us": rpc_us[name],
             "empty_execute_model_rpc_us": empty_step_us[name]} for name in engines]
    base = rows[0]
    for r in rows:
        r["overhead_us_per_step"] = r["us_per_step"] - base["us_per_step"]
        r["best_overhead_us_per_step"] = r["best_us_per_step"] - base["best_us_per_step"]
        r["execute_model_overhead_us_per_step"] = (r["execute_model_us_per_step"]
                                                   - base["execute_model_us_per_step"])
    print(f"\nPer-step time of LLM.generate, {args.num_prompts} prompts x {args.max_tokens} tokens "
          f"({args.model}, {args.threads} thread(s)), median of {args.repeats} interleaved runs")
    print("(best: the fastest run of each; the difference of bests is less exposed to the "
          "machine's other load)")
    print(f"{'engine':<30} {'steps':>6} {'us/step':>9} {'overhead':>9} {'best':>9} "
          f"{'best ovh':>9} {'exec us/step':>13} {'exec overhead':>14} {'bare rpc us':>12} "
          f"{'empty step us':>14}")
    for r in rows:
        print(f"{r['engine']:<30} {r['steps']:>6} {r['us_per_step']:>9.1f} "
              f"{r['overhead_us_per_step']:>+9.1f} {r['best_us_per_step']:>9.1f} "
              f"{r['best_overhead_us_per_step']:>+9.1f} {r['execute_model_us_per_step']:>13.1f} "
              f"{r['execute_model_overhead_us_per_step']:>+14.1f} "
              f"{r['collective_rpc_round_trip_us']:>12.1f} {r['empty_execute_model_rpc_us']:>14.1f}")
    return rows


# Each section takes the parsed args, prints its table and returns JSON-able rows.
SECTIONS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "ipc_round_trip": section_ipc_round_trip,
    "engine_step_overhead": section_engine_step_overhead,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--model", default="demo",
                        help="engine_step_overhead: checkpoint dir or 'demo'")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="engine_step_overhead: torch threads per process")
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
