"""Where a served token's time goes: a kvserve server under `kvserve bench serve`, sampled by
py-spy in the API server process and the engine core process (issue 13, part 2).

For each request rate: start `py-spy record --idle --format raw` on both processes, run the
client (random prompts, --input-len in / --output-len out, ignore_eos), stop py-spy, and split
the samples (wall time, idle included) into:
- engine core, main thread: waiting for work, scheduler, input preparation, the forward
  (linear layers, attention, other kernels), LM head, sampler, the rest of the step;
- engine core, output IO thread: output serialisation + ZMQ send (busy share);
- API server event loop: engine-output handling + detokenisation (AsyncLLM's output handler,
  OutputProcessor, ZMQ receive), HTTP/SSE (ASGI stack, the streaming generators), other, idle.
The client's TTFT / TPOT / ITL p50 and p99 are printed beside it.

    pip install py-spy
    python benchmarks/serve_profile.py [--dtype auto|float32] [--request-rates 0.5,inf]
        [--num-prompts 16] [--input-len 256] [--output-len 64] [--out-dir DIR]
        [--output-json out.json]

--dtype auto serves the bfloat16 copy of the 110M benchmark Llama (16-bit weights, float32 math
on CPUs without bf16 instructions), float32 the float32 checkpoint. py-spy samples 100 times a
second; the client runs on the same machine as the server (as in vs_vllm_cpu.py).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vs_vllm_cpu import Server, port_is_free  # noqa: E402

# (category, frame names): a sample goes to the first category with a frame in its stack.
ENGINE_MAIN = [
    ("idle (waiting for requests)", ("EngineCoreProc._process_input_queue",)),
    ("LM head", ("ParallelLMHead.compute_logits",)),
    ("sampler", ("Sampler.forward",)),
    ("forward: linear layers", ("LinearBase.apply_linear",)),
    ("forward: attention", ("CpuAttentionBackend._decode", "CpuAttentionBackend._prefill")),
    ("forward: other kernels (KV write, rotary, silu, norms)", ("LlamaForCausalLM.forward",)),
    ("input preparation", ("ModelRunner._prepare_inputs",)),
    ("scheduler", ("Scheduler.schedule", "Scheduler.update_from_output")),
    ("rest of the step", ("EngineCore.step",)),
]
API_LOOP = [
    ("idle", ("EpollSelector.select",)),
    ("engine outputs + detokenisation", ("AsyncLLM._run_output_handler.<locals>.output_handler",
                                         "_async_output_reader", "OutputProcessor.process_outputs")),
    ("HTTP / SSE", ("RequestResponseCycle.run_asgi", "StreamingResponse.__call__.<locals>.wrap",
                    "H11Protocol.data_received", "HttpToolsProtocol.data_received")),
]


def split(raw_path: str, thread: str, categories: list[tuple[str, tuple[str, ...]]]
          ) -> dict[str, float]:
    """Share of `thread`'s samples per category (py-spy raw format: 'frame;frame;... count')."""
    counts: collections.Counter[str] = collections.Counter()
    with open(raw_path) as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            frames = stack.split(";")
            if thread not in frames[0]:
                continue
            names = {fr.split(" (")[0] for fr in frames[1:]}
            cat = next((c for c, keys in categories if names.intersection(keys)), "other")
            counts[cat] += int(n)
    total = sum(counts.values()) or 1
    return {c: counts[c] / total for c in [c for c, _ in categories] + ["other"] if counts[c]}


def engine_core_pid(server_pid: int) -> int:
    import psutil
    for child in psutil.Process(server_pid).children(recursive=True):
        if "spawn_main" in " ".join(child.cmdline()):
            return child.pid
    raise RuntimeError("no engine core process under the server")


def record(pid: int, path: str, native: bool) -> subprocess.Popen:
    cmd = ["py-spy", "record", "--pid", str(pid), "--rate", "100", "--idle", "--threads",
           "--format", "raw", "-o", path] + (["--native"] if native else [])
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def client(args: argparse.Namespace, base_url: str, model_id: str, n: int, rate: str,
           out_dir: str, name: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvserve.benchmarks.cli", "serve", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", model_id, "--tokenizer", args.model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(n), "--request-rate", rate, "--ignore-eos", "--seed", "0",
           "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--disable-tqdm", "--save-result", "--result-dir", out_dir, "--result-filename", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, name)) as f:
        raw = json.load(f)
    return {k: raw[k] for k in raw if k.endswith("_ms") or k in ("duration", "completed")}


def profile_rate(args: argparse.Namespace, server: Server, base_url: str, model_id: str,
                 rate: str, out_dir: str) -> dict[str, Any]:
    api_raw, core_raw = (os.path.join(out_dir, f"{p}-rate-{rate}.txt") for p in ("api", "core"))
    spies = [record(server.proc.pid, api_raw, native=False),
             record(engine_core_pid(server.proc.pid), core_raw, native=True)]
    time.sleep(2.0)                                   # py-spy attached
    try:
        metrics = client(args, base_url, model_id, args.num_prompts, rate, out_dir,
                         f"client-rate-{rate}.json")
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)            # py-spy writes its file on Ctrl-C
        for spy in spies:
            spy.wait(60)
    return {"client": metrics,
            "engine_core_main_thread": split(core_raw, "MainThread", ENGINE_MAIN),
            "engine_core_output_io_busy": 1.0 - split(
                core_raw, "EngineCoreOutputIO", [("idle", ("Queue.get",))]).get("idle", 0.0),
            "api_server_event_loop": split(api_raw, "MainThread", API_LOOP)}


def print_report(dtype: str, results: dict[str, Any]) -> None:
    for rate, r in results.items():
        m = r["client"]
        print(f"\n== dtype {dtype}, request rate {rate}: TTFT p50/p99 {m['p50_ttft_ms']:.0f}/"
              f"{m['p99_ttft_ms']:.0f} ms, TPOT {m['p50_tpot_ms']:.1f}/{m['p99_tpot_ms']:.1f} ms, "
              f"ITL {m['p50_itl_ms']:.1f}/{m['p99_itl_ms']:.1f} ms")
        print("engine core main thread (share of wall time):")
        for cat, share in r["engine_core_main_thread"].items():
            print(f"  {100 * share:5.1f}%  {cat}")
        print(f"engine core output IO thread busy (serialisation + ZMQ): "
              f"{100 * r['engine_core_output_io_busy']:.1f}%")
        print("API server event loop (share of wall time):")
        for cat, share in r["api_server_event_loop"].items():
            print(f"  {100 * share:5.1f}%  {cat}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the 110M benchmark Llama")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32"])
    p.add_argument("--request-rates", default="0.5,inf")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--out-dir", default=None, help="py-spy samples and client results")
    p.add_argument("--output-json")
    args = p.parse_args()
    from roofline import DEFAULT_MODEL_DIR, ensure_bench_model, ensure_checkpoint_as
    if args.model is None:
        base = ensure_bench_model(DEFAULT_MODEL_DIR)
        args.model = ensure_checkpoint_as(base, "bfloat16") if args.dtype == "auto" else base
    if not port_is_free(args.port):
        raise SystemExit(f"port {args.port} is taken: pass another --port")
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="serve_profile-")
    os.makedirs(out_dir, exist_ok=True)
    argv = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", args.model, "--host",
            "127.0.0.1", "--port", str(args.port), "--dtype", args.dtype, "--max-model-len",
            str(args.input_len + args.output_len + 16), "--disable-uvicorn-access-log",
            "--uvicorn-log-level", "warning"]
    server = Server(argv, dict(os.environ), os.path.join(out_dir, "server.log"))
    base_url = f"http://127.0.0.1:{args.port}"
    try:
        model_id = server.wait_ready(base_url, 600)
        client(args, base_url, model_id, 4, "inf", out_dir, "warmup.json")
        results = {rate: profile_rate(args, server, base_url, model_id, rate, out_dir)
                   for rate in args.request_rates.split(",")}
    finally:
        server.stop()
    print_report(args.dtype, results)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"dtype": args.dtype, "model": args.model, "num_prompts": args.num_prompts,
                       "input_len": args.input_len, "output_len": args.output_len,
                       "load_average": os.getloadavg(), "rates": results}, f, indent=1)
    print(f"\nsamples and client results: {out_dir}")


if __name__ == "__main__":
    main()
