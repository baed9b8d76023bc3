"""Disaggregated prefill/decode vs one instance (issue 12), with `kvserve bench serve`.

Layout "single": one `kvserve serve` on cores 0-1 (2 torch threads).
Layout "pd": a prefill instance on core 0 and a decode instance on core 1 (taskset, one torch
thread each), NixlConnector between them, `kvserve proxy` in front.

The same requests (long random prompts, long outputs, --ignore-eos) at the same fixed rate go
to each layout in turn; reported: TTFT p50/p99 and ITL p99 of both, and from the decode
instance's /metrics the NIXL transfers (count, bytes, time): bandwidth and time per request.
The proxy and the benchmark client are not pinned (they share the two cores with the engines).

    python benchmarks/pd_disagg.py                     # defaults below
    python benchmarks/pd_disagg.py --num-prompts 4     # quicker
    python benchmarks/pd_disagg.py --smoke             # a tiny model and load: checks it runs

--output-json FILE also writes both results and the transfer counters.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks.roofline import ensure_random_checkpoint  # noqa: E402

# Small enough that a 2k-token prefill takes seconds on one core of these machines.
MODEL_CONFIG = dict(arch="llama", hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=6,
                    intermediate_size=1024, vocab_size=8000, max_position_embeddings=4096,
                    tie_word_embeddings=False, dtype="float32", seed=0)
MODEL_NAME = "llama-pd-bench-v1"
# --smoke: a 2-layer model, short prompts, a few requests (about a minute, mostly start-up).
SMOKE_MODEL_CONFIG = dict(MODEL_CONFIG, hidden_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=4, intermediate_size=256, max_position_embeddings=1024)
SMOKE_MODEL_NAME = "llama-pd-smoke-v1"
SMOKE_ARGS = dict(input_len=256, output_len=32, num_prompts=4, request_rate=2.0)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process in its own session (killed with everything it started)."""

    def __init__(self, argv: list[str], cpus: Optional[str], threads: Optional[int],
                 log_dir: str, name: str) -> None:
        env = dict(os.environ)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        prefix = ["taskset", "-c", cpus] if cpus else []
        self.log = os.path.join(log_dir, name + ".log")
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(prefix + argv, stdout=f, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)

    def wait_ready(self, url: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log, errors="replace") as f:
                    raise RuntimeError(f"exited; the end of {self.log}:\n{f.read()[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"not ready; see {self.log}")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def serve_argv(model: str, port: int, args: argparse.Namespace, kv: bool) -> list[str]:
    argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model, "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
            str(args.input_len + args.output_len + 16), "--kv-cache-memory", str(1 << 29),
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    if kv:
        argv += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
    return argv


def bench(url: str, model: str, args: argparse.Namespace, out_dir: str, label: str) -> dict:
    fname = f"{label}.json"
    subprocess.run(
        [sys.executable, "-m", "kvserve.benchmarks.cli", "serve", "--base-url", url,
         "--tokenizer", model, "--dataset-name", "random", "--random-input-len",
         str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts",
         str(args.num_prompts), "--request-rate", str(args.request_rate), "--ignore-eos",
         "--seed", "0", "--percentile-metrics", "ttft,itl,tpot,e2el", "--metric-percentiles",
         "50,99", "--disable-tqdm", "--save-result", "--result-dir", out_dir,
         "--result-filename", fname, "--label", label], check=True)
    with open(os.path.join(out_dir, fname)) as f:
        return json.load(f)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^kvserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def run_single(model: str, args: argparse.Namespace, tmp: str) -> dict:
    port = _free_port()
    srv = Proc(serve_argv(model, port, args, kv=False), "0,1", 2, tmp, "single")
    try:
        srv.wait_ready(f"http://127.0.0.1:{port}/health")
        return bench(f"http://127.0.0.1:{port}", model, args, tmp, "single")
    finally:
        srv.stop()


def run_pd(model: str, args: argparse.Namespace, tmp: str) -> tuple[dict, dict]:
    pp, dp, xp = _free_port(), _free_port(), _free_port()
    procs = [Proc(serve_argv(model, pp, args, kv=True), "0", 1, tmp, "prefill"),
             Proc(serve_argv(model, dp, args, kv=True), "1", 1, tmp, "decode")]
    try:
        for p, port in zip(procs, (pp, dp)):
            p.wait_ready(f"http://127.0.0.1:{port}/health")
        procs.append(Proc([sys.executable, "-m", "kvserve.entrypoints.cli", "proxy", "--port",
                           str(xp), "--prefill", f"http://127.0.0.1:{pp}", "--decode",
                           f"http://127.0.0.1:{dp}"], None, None, tmp, "proxy"))
        procs[-1].wait_ready(f"http://127.0.0.1:{xp}/health")
        result = bench(f"http://127.0.0.1:{xp}", model, args, tmp, "pd")
        dec = f"http://127.0.0.1:{dp}"
        xfer = {k: metric(dec, k) for k in ("kv_transfers_total", "kv_transfer_bytes_total",
                                            "kv_transfer_time_seconds_total",
                                            "kv_transfer_local_fallbacks_total",
                                            "external_prefix_cache_hits_total")}
        return result, xfer
    finally:
        for p in reversed(procs):
            p.stop()


def report(single: dict, pd: dict, xfer: dict[str, Any], args: argparse.Namespace) -> str:
    rows = [("TTFT p50 (ms)", "p50_ttft_ms"), ("TTFT p99 (ms)", "p99_ttft_ms"),
            ("ITL p50 (ms)", "p50_itl_ms"), ("ITL p99 (ms)", "p99_itl_ms"),
            ("TPOT mean (ms)", "mean_tpot_ms"), ("output tok/s", "output_throughput")]
    lines = [f"{args.num_prompts} requests x {args.input_len} in / {args.output_len} out, "
             f"{args.request_rate} req/s", "| | single (2 cores) | P/D (1 + 1 core) | single / P/D |",
             "|---|---|---|---|"]
    for label, key in rows:
        a, b = single[key], pd[key]
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {a / b if b else float('nan'):.2f} |")
    n, nbytes, secs = (xfer["kv_transfers_total"], xfer["kv_transfer_bytes_total"],
                       xfer["kv_transfer_time_seconds_total"])
    if n:
        lines.append(f"NIXL: {int(n)} READs, {nbytes / n / 2**20:.1f} MiB and {secs / n * 1e3:.1f} ms "
                     f"per request (READ posted to done, polled once per engine step), "
                     f"{nbytes / secs / 1e9:.2f} GB/s; local fallbacks "
                     f"{int(xfer['kv_transfer_local_fallbacks_total'])}; completed "
                     f"{single['completed']} / {pd['completed']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=str, default=None)
    parser.add_argument("--model-dir", type=str, default=os.path.join(HERE, ".models"))
    parser.add_argument("--input-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8)
    # One 2048-token prefill took 11.4 s on one pinned core of the 2-core dev machine under load
    # (about 6 s of CPU): 0.1 req/s keeps the 1-core prefill instance below saturation.
    parser.add_argument("--request-rate", type=float, default=0.1)
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny model and load ({SMOKE_ARGS}): checks the script end to end")
    parser.add_argument("--output-json", type=str, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE_ARGS.items():
            setattr(args, key, value)
        name, config = SMOKE_MODEL_NAME, SMOKE_MODEL_CONFIG
    else:
        name, config = MODEL_NAME, MODEL_CONFIG
    model = args.model or ensure_random_checkpoint(name, config, args.model_dir)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        single = run_single(model, args, tmp)
        pd, xfer = run_pd(model, args, tmp)
    print(report(single, pd, xfer, args))
    print(f"wall time {time.monotonic() - started:.0f} s (start-up included)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(args=vars(args), single=single, pd=pd, nixl=xfer), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
