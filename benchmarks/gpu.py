"""The CUDA path against Hugging Face `generate` on one GPU (issue 10's benchmark). Not a test.

Model: a random 1B Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192,
vocab 8192), bfloat16, built once under --model-dir. In one run:

1. offline throughput: 256 requests, prompts uniform in 128..1024 random tokens, 256 output
   tokens each, greedy, EOS ignored; kvserve (TRITON_ATTN, CUDA graphs) in one LLM.generate
   vs HF `generate` on left-padded length-sorted batches of 32 and 64 (the best is the peer);
2. batch-1 decode tok/s (prefill excluded: a 1-token run subtracted) vs the bandwidth limit
   = measured device copy bandwidth / bytes of weights read per decode step;
3. TTFT of one 4096-token prompt (max_tokens=1);
4. the same throughput and batch-1 runs with enforce_eager=True (graphs off), and with
   --async-scheduling (the engine core schedules step N+1 while step N runs);
5. per batch-1 decode step (torch.profiler, prefill excluded: a 1-token run subtracted): GPU
   kernels launched, host (process) CPU ms and wall ms, async scheduling off and on;
6. the served path: `kvserve serve` (engine core in its own process) driven by
   `kvserve bench serve`, random 512 in / 128 out, 256 prompts at 16 req/s and at saturation,
   async scheduling off and on; TTFT / TPOT / ITL and throughput, and the offline-vs-served
   throughput gap at saturation (same requests through LLM.generate).

Goals (issue 31) on an H100: kvserve >= 20x HF throughput; batch-1 >= 70% of the bandwidth
limit; TTFT 4k <= 40 ms; <= 150 kernels per decode step; served gap at saturation <= 10%.

    python benchmarks/gpu.py [--num-prompts 256] [--output-len 256] [--hf-batch-sizes 32 64]
        [--attention-backend TRITON_ATTN] [--skip-serve] [--output-json results/gpu.json]

`--smoke`: a tiny random model, a few requests and no peer, on CPU when no GPU is there (to
check that the script runs; its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.roofline import ensure_random_checkpoint  # noqa: E402
from kvserve.benchmarks.datasets import SampleRequest  # noqa: E402
from kvserve.benchmarks.throughput import load_hf_model, run_hf, run_kvserve  # noqa: E402

MODEL_CONFIG: dict[str, Any] = dict(
    arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
    intermediate_size=8192, vocab_size=8192, max_position_embeddings=8192,
    tie_word_embeddings=False, dtype="bfloat16", seed=0)
MODEL_NAME = "llama-1b-random-bf16-v1"
SMOKE_CONFIG: dict[str, Any] = dict(
    arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=2048,
    tie_word_embeddings=False, dtype="float32", seed=0)
SMOKE_NAME = "llama-smoke-random-f32-v1"
GOAL_RATIO, GOAL_BATCH1, GOAL_KERNELS, GOAL_GAP = 20.0, 0.7, 150, 0.10


def make_requests(n: int, lo: int, hi: int, out_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [SampleRequest([rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))], out_len)
            for _ in range(n)]


def copy_bandwidth_gb_s(size_mb: int = 1024, iters: int = 10) -> float:
    x = torch.ones(size_mb << 18, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * x.numel() * 4 / best / 1e9     # bytes read + written


def weight_bytes_per_decode(path: str) -> int:
    """Every parameter except the embedding table (one row read per token) is streamed."""
    from safetensors import safe_open
    total = 0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "embed_tokens" not in name:
                t = f.get_slice(name)
                n = 1
                for s in t.get_shape():
                    n *= s
                total += n * 2                                   # bfloat16
    return total


def batch1_decode(llm, prompt: list[int], out_len: int) -> float:
    from kvserve import SamplingParams
    p = {"prompt_token_ids": prompt}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llm.generate(p, many, use_tqdm=False)                       # warm-up
    t = time.perf_counter(); llm.generate(p, one, use_tqdm=False); t1 = time.perf_counter() - t
    t = time.perf_counter(); llm.generate(p, many, use_tqdm=False); tn = time.perf_counter() - t
    return (out_len - 1) / (tn - t1)


def _profiled_generate(llm, prompts, sp, device: str, **kw):
    """One profiled llm.generate: GPU kernel launches and GPU us by kernel name (memcpy and
    memset left out), the number of aten ops, and host us by op name (self time of the aten
    ops and CUDA runtime calls: a stream sync's wait shows here)."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        llm.generate(prompts, sp, use_tqdm=False, **kw)
    events = prof.events()
    names, busy, host = Counter(), Counter(), Counter()
    for e in events:
        if (e.device_type == torch.autograd.DeviceType.CUDA
                and not e.name.startswith(("Memcpy", "Memset"))):
            names[e.name] += 1
            busy[e.name] += e.time_range.elapsed_us()
        elif e.device_type == torch.autograd.DeviceType.CPU:
            host[e.name] += e.self_cpu_time_total
    return names, busy, sum(1 for e in events if e.name.startswith("aten::")), host


def top_kernels(names: Counter, busy: Counter, scale: float = 1.0, n: int = 30) -> dict:
    """name -> (launches, GPU us) over `scale`, the n largest by GPU time: what to fuse next."""
    rows = {k[:90]: (names[k] / scale, busy[k] / scale) for k in names if names[k] > 0}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][1])[:n])


def top_host_ops(b: Counter, a: Counter, steps: int, n: int = 15) -> dict:
    """op name -> host us per step (self time, profiled run of steps + 1 tokens minus the
    1-token run's), the n largest: where a host-bound step's time goes."""
    rows = {k[:90]: round((b[k] - a[k]) / steps, 1) for k in b}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1])[:n])


def decode_step_profile(llm, prompt, steps: int, device: str,
                        lora_request=None) -> dict[str, float]:
    """Per decode step: GPU kernels (torch.profiler), host CPU ms (process time, all threads)
    and wall ms; a 1-token run is subtracted so the prefill is not counted. `prompt`: one
    prompt's token ids (batch 1) or a list of them (a batch; `lora_request` as generate's)."""
    from kvserve import SamplingParams
    batch = [prompt] if prompt and isinstance(prompt[0], int) else prompt
    p = [{"prompt_token_ids": q} for q in batch]
    kw = {"lora_request": lora_request} if lora_request is not None else {}
    runs = {}
    for n in (1, steps + 1):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(p, sp, use_tqdm=False, **kw)               # warm-up (and graphs)
        names, busy, aten, host = _profiled_generate(llm, p, sp, device, **kw)
        c, t = time.process_time(), time.perf_counter()        # unprofiled for the times
        llm.generate(p, sp, use_tqdm=False, **kw)
        runs[n] = (names, aten, time.process_time() - c, time.perf_counter() - t, busy, host)
    a, b = runs[1], runs[steps + 1]
    return {"kernels_per_step": (sum(b[0].values()) - sum(a[0].values())) / steps,
            "gpu_busy_ms_per_step": (sum(b[4].values()) - sum(a[4].values())) / steps / 1e3,
            "aten_ops_per_step": (b[1] - a[1]) / steps,
            "cpu_ms_per_step": (b[2] - a[2]) / steps * 1e3,
            "wall_ms_per_step": (b[3] - a[3]) / steps * 1e3,
            "kernels_by_name": top_kernels(b[0] - a[0], b[4] - a[4], steps),
            "host_us_by_op": top_host_ops(b[5], a[5], steps)}


def host_profile(llm, prompt, steps: int, out_path: str, lora_request=None) -> None:
    """cProfile of one run of `steps` decode steps: where the host's time per step goes (the
    top functions by own time and by cumulative time, written to out_path). `prompt`: one
    prompt's token ids (batch 1) or a list of them (a batch; `lora_request` as generate's)."""
    import cProfile
    import io
    import pstats

    from kvserve import SamplingParams
    batch = [prompt] if prompt and isinstance(prompt[0], int) else prompt
    p = [{"prompt_token_ids": q} for q in batch]
    kw = {"lora_request": lora_request} if lora_request is not None else {}
    sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    llm.generate(p, sp, use_tqdm=False, **kw)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(p, sp, use_tqdm=False, **kw)
    prof.disable()
    buf = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
    with open(out_path, "w") as f:
        f.write(f"batch {len(batch)}, {steps} decode steps\n" + buf.getvalue())


def run_kvserve_all(path: str, requests, args, enforce_eager: bool,
                    async_scheduling: bool = False) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams
    llm = LLM(path, dtype=args.dtype, device=args.device, enforce_eager=enforce_eager,
              attention_backend=args.attention_backend, max_model_len=args.max_model_len,
              max_num_seqs=256, multiprocessing=False, async_scheduling=async_scheduling,
              compilation_config=_compilation_config(args))
    elapsed, outs = run_kvserve(requests, llm)
    prompt = requests[0].prompt_token_ids
    res = {"throughput_tok_s": sum(outs) / elapsed, "elapsed_s": elapsed,
           "batch1_tok_s": batch1_decode(llm, prompt, args.batch1_len),
           "decode_step": decode_step_profile(llm, prompt, args.profile_steps, args.device)}
    if args.host_profile_dir:
        os.makedirs(args.host_profile_dir, exist_ok=True)
        host_profile(llm, prompt, args.profile_steps * 2, os.path.join(
            args.host_profile_dir, f"host_{'eager' if enforce_eager else 'graphs'}"
                                   f"{'_async' if async_scheduling else ''}.txt"))
    if not enforce_eager:
        long_prompt = {"prompt_token_ids": [random.Random(1).randrange(5, args.vocab)
                                            for _ in range(args.ttft_len)]}
        one = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate(long_prompt, one, use_tqdm=False)           # warm-up
        llm.reset_prefix_cache()                                 # the timed run is no cache hit
        _sync(args.device)
        t = time.perf_counter()
        llm.generate(long_prompt, one, use_tqdm=False)
        res["ttft_long_ms"] = (time.perf_counter() - t) * 1e3
        llm.reset_prefix_cache()            # where the TTFT goes: its kernels, GPU busy time
        names, busy, _, _ = _profiled_generate(llm, long_prompt, one, args.device)
        res["ttft_long_gpu_busy_ms"] = sum(busy.values()) / 1e3
        res["ttft_long_kernels"] = top_kernels(names, busy, n=20)
    if args.serve_offline:       # the served workload offline: the gap's reference
        served = make_requests(args.serve_num_prompts, args.serve_input_len,
                               args.serve_input_len, args.serve_output_len, args.vocab, seed=2)
        elapsed, outs = run_kvserve(served, llm)
        res["serve_workload_offline_tok_s"] = sum(outs) / elapsed
    del llm
    _free(args.device)
    return res


def _compilation_config(args) -> Optional[dict[str, str]]:
    return {"cudagraph_mode": args.cudagraph_mode} if args.cudagraph_mode else None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def served_run(path: str, args, async_scheduling: bool) -> dict[str, Any]:
    """`kvserve serve` in its own processes, `kvserve bench serve` against it at each rate."""
    import subprocess
    import tempfile
    port = _free_port()
    out_dir = tempfile.mkdtemp(prefix="kvserve-gpu-serve-")
    cmd = [sys.executable, "-m", "kvserve", "serve", path, "--port", str(port),
           "--dtype", args.dtype, "--device", args.device, "--max-model-len",
           str(args.max_model_len), "--disable-uvicorn-access-log"]
    if args.attention_backend:
        cmd += ["--attention-backend", args.attention_backend]
    if async_scheduling:
        cmd.append("--async-scheduling")
    if args.cudagraph_mode:
        cmd += ["--compilation-config", json.dumps(_compilation_config(args))]
    if args.serve_api_server_count > 1:
        cmd += ["--api-server-count", str(args.serve_api_server_count)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    log = open(os.path.join(out_dir, "server.log"), "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    res: dict[str, Any] = {}
    try:
        for rate in args.serve_rates:
            name = f"rate-{rate}.json"
            bench = [sys.executable, "-m", "kvserve", "bench", "serve", "--port", str(port),
                     "--dataset-name", "random", "--random-input-len", str(args.serve_input_len),
                     "--random-output-len", str(args.serve_output_len), "--random-range-ratio",
                     "0", "--num-prompts", str(args.serve_num_prompts), "--request-rate", rate,
                     "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl",
                     "--metric-percentiles", "50,99", "--save-result", "--result-dir", out_dir,
                     "--result-filename", name, "--ready-check-timeout-sec", "900"]
            subprocess.run(bench, env=env, check=True, timeout=args.serve_timeout_s)
            with open(os.path.join(out_dir, name)) as f:
                r = json.load(f)
            res[rate] = {k: r.get(k) for k in (
                "completed", "failed", "output_throughput", "total_token_throughput",
                "request_throughput", "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms")}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    res["log"] = os.path.join(out_dir, "server.log")
    return res


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/kvserve/bench"))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-prompt-len", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--attention-backend", default="TRITON_ATTN")
    ap.add_argument("--cudagraph-mode", choices=["NONE", "FULL_DECODE_ONLY", "FULL"],
                    help="compilation_config's cudagraph_mode (default: the engine's, "
                         "FULL_DECODE_ONLY); FULL also replays mixed steps <= 512 tokens.")
    ap.add_argument("--profile-steps", type=int, default=32,
                    help="Decode steps profiled for the per-step kernel count and CPU time.")
    ap.add_argument("--skip-serve", action="store_true", help="No served run (part 6).")
    ap.add_argument("--serve-num-prompts", type=int, default=256)
    ap.add_argument("--serve-input-len", type=int, default=512)
    ap.add_argument("--serve-output-len", type=int, default=128)
    ap.add_argument("--serve-rates", nargs="+", default=["16", "inf"])
    ap.add_argument("--serve-modes", nargs="+", choices=["sync", "async"],
                    default=["sync", "async"], help="the served runs' schedulers")
    ap.add_argument("--serve-timeout-s", type=float, default=1800)
    ap.add_argument("--serve-api-server-count", type=int, default=1,
                    help="API server processes of the served run: one streams ~11k tok/s on "
                         "the H100 host (~200 us of CPU a streamed token), below the engine.")
    ap.add_argument("--smoke", action="store_true",
                    help="Tiny model, few requests, no peer; on CPU without a GPU.")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="Which parts to run (each in turn; a failing part is recorded in the "
                         "JSON and the others still run).")
    ap.add_argument("--host-profile-dir",
                    help="Write a cProfile of a batch-1 run per engine setting here.")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype, args.max_model_len, args.batch1_len, args.ttft_len = "bfloat16", 8192, 128, 4096
    if args.smoke:
        args.num_prompts, args.min_prompt_len, args.max_prompt_len = 8, 16, 64
        args.output_len, args.hf_batch_sizes, args.profile_steps = 8, [], 4
        args.serve_num_prompts, args.serve_input_len, args.serve_output_len = 8, 32, 8
        args.max_model_len, args.batch1_len, args.ttft_len = 512, 8, 256
        if args.device == "cpu":
            args.dtype, args.attention_backend = "float32", None
    args.serve_offline = not args.skip_serve and "serve" in args.parts
    return args


PARTS = ("graphs", "async", "eager", "serve", "hf")


def _run_part(result: dict[str, Any], key: str, fn, args: argparse.Namespace) -> None:
    """One part of the run; a failure is recorded and the next part still runs (a GPU lease is
    short: one crash must not cost the other numbers). The JSON is rewritten after each part."""
    import traceback
    t = time.perf_counter()
    try:
        result[key] = fn()
    except Exception:                                   # noqa: BLE001 - recorded, reported
        result[key] = {"error": traceback.format_exc()}
        print(f"part {key} failed:\n{result[key]['error']}", file=sys.stderr, flush=True)
    print(f"part {key}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    _free(args.device)
    _write_json(result, args)


def _write_json(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2, default=str)


def _hf_part(path: str, requests, args: argparse.Namespace) -> dict[int, float]:
    hf = load_hf_model(path, getattr(torch, args.dtype), args.device)
    res = {}
    for b in args.hf_batch_sizes:
        elapsed, outs = run_hf(requests, hf, b)
        res[b] = sum(outs) / elapsed
    del hf
    return res


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.device != "cuda" and not args.smoke:
        print("benchmarks/gpu.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    name, config = (SMOKE_NAME, SMOKE_CONFIG) if args.smoke else (MODEL_NAME, MODEL_CONFIG)
    path = ensure_random_checkpoint(name, config, args.model_dir)
    args.vocab = config["vocab_size"]
    requests = make_requests(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                             args.output_len, args.vocab)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "model": config, "num_prompts": args.num_prompts, "hf": {}}
    parts = {
        "graphs": ("kvserve", lambda: run_kvserve_all(path, requests, args, False)),
        "async": ("kvserve_async", lambda: run_kvserve_all(path, requests, args, False, True)),
        "eager": ("kvserve_enforce_eager", lambda: run_kvserve_all(path, requests, args, True)),
        "serve": ("served", lambda: {mode: served_run(path, args, mode == "async")
                                     for mode in args.serve_modes}),
        "hf": ("hf", lambda: _hf_part(path, requests, args)),
    }
    for part in args.parts:
        if part == "serve" and args.skip_serve or part == "hf" and not args.hf_batch_sizes:
            continue
        _run_part(result, *parts[part], args)
    summarize(result, path, args)
    _write_json(result, args)
    return 0


def summarize(result: dict[str, Any], path: str, args: argparse.Namespace) -> None:
    ok = {k: r for k in ("kvserve", "kvserve_async", "kvserve_enforce_eager")
          if isinstance(r := result.get(k), dict) and "error" not in r}
    kv, ka = ok.get("kvserve", {}), ok.get("kvserve_async", {})
    lines = [f"{result['device']}:"] + [f"  {k}: FAILED (see the JSON)" for k in (
        "kvserve", "kvserve_async", "kvserve_enforce_eager", "served", "hf")
        if isinstance(result.get(k), dict) and "error" in result[k]]
    if args.device == "cuda":
        bw = copy_bandwidth_gb_s()
        limit = bw * 1e9 / weight_bytes_per_decode(path)
        result.update(copy_bandwidth_gb_s=bw, batch1_limit_tok_s=limit)
        if kv:
            result["batch1_fraction"] = kv["batch1_tok_s"] / limit
        if ka:
            result["batch1_fraction_async"] = ka["batch1_tok_s"] / limit
        lines.append(f"  batch-1 limit {limit:.0f} tok/s (copy {bw:.0f} GB/s); goal "
                     f"{GOAL_BATCH1:.0%}")
    if result["hf"] and "error" not in result["hf"] and kv:
        best_hf = max(result["hf"].values())
        result["ratio_vs_hf"] = kv["throughput_tok_s"] / best_hf
        lines.append(f"  HF best {best_hf:.0f} tok/s; goal {GOAL_RATIO}x")
    for label, key in (("graphs", "kvserve"), ("graphs+async", "kvserve_async"),
                       ("eager", "kvserve_enforce_eager")):
        if key not in ok:
            continue
        r = ok[key]
        d = r["decode_step"]
        lines.append(
            f"  {label:13s} offline {r['throughput_tok_s']:8.0f} tok/s | batch-1 "
            f"{r['batch1_tok_s']:7.0f} tok/s | per decode step: {d['kernels_per_step']:.0f} "
            f"kernels (goal <= {GOAL_KERNELS}), GPU busy {d['gpu_busy_ms_per_step']:.2f} ms, "
            f"{d['aten_ops_per_step']:.0f} aten ops, CPU "
            f"{d['cpu_ms_per_step']:.2f} ms, wall {d['wall_ms_per_step']:.2f} ms"
            + (f" | TTFT {args.ttft_len} {r['ttft_long_ms']:.0f} ms (GPU busy "
               f"{r.get('ttft_long_gpu_busy_ms', float('nan')):.1f} ms)" if "ttft_long_ms" in r
               else ""))
    served_all = result.get("served", {})
    for mode, served in ({} if "error" in served_all else served_all).items():
        offline = (ka if mode == "async" else kv).get("serve_workload_offline_tok_s")
        for rate, r in list(served.items()):
            if rate == "log":
                continue
            gap = (1 - r["output_throughput"] / offline) if offline and rate == "inf" else None
            if gap is not None:
                served[f"gap_vs_offline_{rate}"] = gap
            lines.append(
                f"  served {mode:5s} @ {rate:>4s} req/s: {r['output_throughput']:.0f} tok/s, TTFT "
                f"mean {r['mean_ttft_ms']:.1f} p99 {r['p99_ttft_ms']:.1f} ms, TPOT mean "
                f"{r['mean_tpot_ms']:.2f} ms, ITL mean {r['mean_itl_ms']:.2f} ms"
                + (f", gap vs offline {gap:.1%} (goal <= {GOAL_GAP:.0%})" if gap is not None
                   else ""))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
