"""Disaggregated prefill/decode vs one instance (issue 12), with `kvserve bench serve`.

Layout "single": one `kvserve serve` on cores 0-1 (2 torch threads), once per step token budget
in --single-budgets (2048 is the CPU default; a smaller budget is what a latency-minded operator
sets: shorter but more frequent prefill stalls).
Layout "pd": a prefill instance on core 0 and a decode instance on core 1 (taskset, one torch
thread each), NixlConnector between them, `kvserve proxy` in front.

The workload is a mix at fixed rates, sent to each layout in turn by two concurrent
`kvserve bench serve` clients (random prompts, --ignore-eos, Poisson arrivals, fixed seeds):
  long prompts:  --long-input-len (2048) in, --long-output-len out, --long-rate req/s
  long outputs:  --short-input-len in, --short-output-len (256) out, --short-rate req/s
What P/D is for: in one instance every prefill chunk of a long prompt stalls all running
decodes for a step; a P/D decode instance never runs one. Reported per layout: ITL p50/p99/
p99.9/max over every token of both classes, TTFT p50/p99 per class (P/D's cost: a 2k prefill on
one core), and from the decode instance's /metrics the NIXL transfers (count, bytes, time).
The proxy and the benchmark clients are not pinned (they share the two cores with the engines).

    python benchmarks/pd_disagg.py                     # defaults below (~20 min)
    python benchmarks/pd_disagg.py --duration-s 120    # quicker
    python benchmarks/pd_disagg.py --smoke             # a tiny model and load: checks it runs

--output-json FILE also writes every result and the transfer counters.
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
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks.roofline import ensure_random_checkpoint  # noqa: E402
from kvserve.benchmarks.serve import strip_detailed  # noqa: E402

# Small enough that a 2k-token prefill takes seconds on one core of these machines.
MODEL_CONFIG = dict(arch="llama", hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=6,
                    intermediate_size=1024, vocab_size=8000, max_position_embeddings=4096,
                    tie_word_embeddings=False, dtype="float32", seed=0)
MODEL_NAME = "llama-pd-bench-v1"
# --smoke: a 2-layer model, short prompts, a few requests (about a minute, mostly start-up).
SMOKE_MODEL_CONFIG = dict(MODEL_CONFIG, hidden_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=4, intermediate_size=256, max_position_embeddings=1024)
SMOKE_MODEL_NAME = "llama-pd-smoke-v1"
SMOKE_ARGS = dict(long_input_len=256, long_output_len=8, long_rate=1.0, short_input_len=32,
                  short_output_len=32, short_rate=2.0, duration_s=3.0, single_budgets="256,64")


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


def serve_argv(model: str, port: int, args: argparse.Namespace, kv: bool,
               budget: Optional[int] = None) -> list[str]:
    max_len = max(args.long_input_len + args.long_output_len,
                  args.short_input_len + args.short_output_len) + 16
    argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", model, "--host",
            "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len",
            str(max_len), "--kv-cache-memory", str(1 << 29),
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    if budget is not None:
        argv += ["--max-num-batched-tokens", str(budget)]
    if kv:
        argv += ["--kv-transfer-config", json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
    return argv


CLASSES = ("long", "short")   # long prompts / long outputs


def bench(url: str, model: str, args: argparse.Namespace, out_dir: str, label: str) -> dict:
    """Both request classes at once, each from its own client at its own rate; returns each
    client's detailed result (per-request TTFTs and ITLs)."""
    procs, files = {}, {}
    for i, cls in enumerate(CLASSES):
        rate = getattr(args, f"{cls}_rate")
        files[cls] = f"{label}-{cls}.json"
        procs[cls] = subprocess.Popen(
            [sys.executable, "-m", "kvserve.benchmarks.cli", "serve", "--base-url", url,
             "--tokenizer", model, "--dataset-name", "random",
             "--random-input-len", str(getattr(args, f"{cls}_input_len")),
             "--random-output-len", str(getattr(args, f"{cls}_output_len")),
             "--num-prompts", str(max(1, round(rate * args.duration_s))),
             "--request-rate", str(rate), "--ignore-eos", "--seed", str(i + 1),
             "--percentile-metrics", "ttft,itl,tpot,e2el", "--metric-percentiles", "50,99",
             "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", out_dir,
             "--result-filename", files[cls], "--label", f"{label}-{cls}"])
    for cls, proc in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"the {cls} client of {label} failed ({proc.returncode})")
    out = {}
    for cls in CLASSES:
        with open(os.path.join(out_dir, files[cls])) as f:
            out[cls] = json.load(f)
    return out


def percentile(values: list[float], q: float) -> float:
    """numpy's percentile (as `kvserve bench serve` reports them), NaN for no samples."""
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(result: dict) -> dict[str, float]:
    """ITL percentiles over every token of both classes; TTFT per class; in ms."""
    itls = [1000 * x for cls in CLASSES for req in result[cls]["itls"] for x in req]
    out = {"itl_samples": len(itls), "completed": sum(result[c]["completed"] for c in CLASSES)}
    for q in (50, 99, 99.9, 100):
        out[f"itl_p{q:g}_ms"] = percentile(itls, q)
    for cls in CLASSES:
        ttfts = [1000 * x for x in result[cls]["ttfts"] if x]
        for q in (50, 99):
            out[f"{cls}_ttft_p{q}_ms"] = percentile(ttfts, q)
    out["output_tok_s"] = sum(result[c]["output_throughput"] for c in CLASSES)
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^kvserve:{name}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def run_single(model: str, args: argparse.Namespace, tmp: str, budget: int) -> dict:
    port = _free_port()
    label = f"single-{budget}"
    srv = Proc(serve_argv(model, port, args, kv=False, budget=budget), "0,1", 2, tmp, label)
    try:
        srv.wait_ready(f"http://127.0.0.1:{port}/health")
        return bench(f"http://127.0.0.1:{port}", model, args, tmp, label)
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


ROWS = [("ITL p50 (ms)", "itl_p50_ms"), ("ITL p99 (ms)", "itl_p99_ms"),
        ("ITL p99.9 (ms)", "itl_p99.9_ms"), ("ITL max (ms)", "itl_p100_ms"),
        ("TTFT p50, long prompts (ms)", "long_ttft_p50_ms"),
        ("TTFT p99, long prompts (ms)", "long_ttft_p99_ms"),
        ("TTFT p50, long outputs (ms)", "short_ttft_p50_ms"),
        ("TTFT p99, long outputs (ms)", "short_ttft_p99_ms"),
        ("output tok/s", "output_tok_s"), ("ITL samples", "itl_samples"),
        ("completed", "completed")]


def report(summaries: dict[str, dict], xfer: dict[str, Any], args: argparse.Namespace) -> str:
    names = list(summaries)
    lines = [f"mix for {args.duration_s:g} s: long prompts {args.long_input_len} in / "
             f"{args.long_output_len} out at {args.long_rate} req/s + long outputs "
             f"{args.short_input_len} in / {args.short_output_len} out at {args.short_rate} req/s",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for label, key in ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{summaries[n][key]:.1f}" for n in names) + " |")
    pd = summaries["pd"]
    for n in names[:-1]:
        lines.append(f"ITL p99 {n} / pd: {summaries[n]['itl_p99_ms'] / pd['itl_p99_ms']:.2f}x; "
                     f"p99.9: {summaries[n]['itl_p99.9_ms'] / pd['itl_p99.9_ms']:.2f}x")
    n, nbytes, secs = (xfer["kv_transfers_total"], xfer["kv_transfer_bytes_total"],
                       xfer["kv_transfer_time_seconds_total"])
    if n:
        lines.append(f"NIXL: {int(n)} READs, {nbytes / n / 2**20:.1f} MiB and {secs / n * 1e3:.1f} ms "
                     f"per request (READ posted to done, polled once per engine step), "
                     f"{nbytes / secs / 1e9:.2f} GB/s; local fallbacks "
                     f"{int(xfer['kv_transfer_local_fallbacks_total'])}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=str, default=None)
    parser.add_argument("--model-dir", type=str, default=os.path.join(HERE, ".models"))
    parser.add_argument("--long-input-len", type=int, default=2048)
    parser.add_argument("--long-output-len", type=int, default=32)
    # A 2048-token prefill takes about 6 s on one pinned core of the 2-core dev machine: at
    # 0.1 req/s the 1-core prefill instance is about 60% busy.
    parser.add_argument("--long-rate", type=float, default=0.1)
    parser.add_argument("--short-input-len", type=int, default=128)
    parser.add_argument("--short-output-len", type=int, default=256)
    parser.add_argument("--short-rate", type=float, default=0.15)
    parser.add_argument("--duration-s", type=float, default=300.0,
                        help="requests per class = rate x duration")
    parser.add_argument("--single-budgets", type=str, default="2048,512",
                        help="max_num_batched_tokens of the single-instance runs")
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
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        for budget in (int(b) for b in args.single_budgets.split(",") if b):
            results[f"single-{budget}"] = run_single(model, args, tmp, budget)
        results["pd"], xfer = run_pd(model, args, tmp)
    summaries = {name: summarize(r) for name, r in results.items()}
    print(report(summaries, xfer, args))
    print(f"wall time {time.monotonic() - started:.0f} s (start-up included)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(args=vars(args), summaries=summaries, nixl=xfer,
                           results={n: {c: strip_detailed(r[c]) for c in CLASSES}
                                    for n, r in results.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
