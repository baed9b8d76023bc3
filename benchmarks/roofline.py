"""Roofline: what this machine allows a checkpoint, and how close kvserve gets.

Measures, in this process:
- memory bandwidth: reading (sum) and copying a tensor far larger than the caches;
- matmul FLOP/s, float32 and bfloat16, for (M, 2048) x (2048, 2048) with M = 1, 16, 256 and
  for 2048^3;

then prints for the checkpoint, per dtype:
- the batch-1 decode limit: read bandwidth / bytes of weights one decode step streams (every
  parameter except the input embedding table, which is only indexed; the KV cache read at
  short contexts is ignored, as it is < 2% of the weights here);
- the compute limit: peak matmul FLOP/s / (2 x those parameters) tokens/s;
- kvserve's measured batch-1 and large-batch decode tokens/s as a fraction of each (the limit
  at batch B is min(B x bandwidth limit, compute limit)).

    python benchmarks/roofline.py [--model PATH] [--dtypes float32 bfloat16]
                                  [--large-batch 64] [--output-json out.json]

Without --model it uses the ~110M-parameter Llama of offline_vs_hf.py (built once under
--model-dir). Attention FLOPs are ignored in the compute limit (a few % at these lengths).
Absolute numbers drift on shared machines: compare fractions from one run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import sys
import time
from typing import Any, Callable, Optional

import torch

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".models")

# The ~110M-parameter Llama of issue 2's benchmark (hidden 768, 12 layers, 12 heads).
BENCH_MODEL_CONFIG: dict[str, Any] = dict(
    arch="llama", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12,
    intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048,
    tie_word_embeddings=False, dtype="float32", seed=0)
BENCH_MODEL_NAME = "llama-110m-random-v1"     # change it whenever the config changes


def ensure_random_checkpoint(name: str, config: dict, model_dir: str = DEFAULT_MODEL_DIR) -> str:
    """A random checkpoint `model_dir/name` built once with kvserve's random-checkpoint writer
    from `config` and reused from then on (change `name` whenever `config` changes)."""
    from kvserve.model.demo import build_random_checkpoint

    path = os.path.join(model_dir, name)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        tmp = path + f".tmp-{os.getpid()}"
        print(f"Building the benchmark model in {path} ...", file=sys.stderr)
        build_random_checkpoint(tmp, **config)
        os.replace(tmp, path)     # appears complete or not at all
    return path


def ensure_bench_model(model_dir: str = DEFAULT_MODEL_DIR) -> str:
    """The benchmark checkpoint (float32 weights; bfloat16 runs cast them at load time)."""
    return ensure_random_checkpoint(BENCH_MODEL_NAME, BENCH_MODEL_CONFIG, model_dir)


def ensure_checkpoint_as(path: str, dtype: str) -> str:
    """A copy of checkpoint `path` with its weights (and config's torch_dtype) in `dtype`, as
    real 16-bit checkpoints ship: what dtype="auto" sees. Made once, beside `path`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out = f"{path}-{dtype}"
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    tmp = out + f".tmp-{os.getpid()}"
    shutil.copytree(path, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file({k: v.to(dtype_of(dtype)) if v.is_floating_point() else v
               for k, v in tensors.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = dtype
    cfg.pop("dtype", None)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(tmp, out)
    return out


# ---------------------------------------------------------------------------------------------
# Machine measurements

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    fn()                                   # warm-up: page faults, kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_memory_bandwidth(size_mb: int = 512, iters: int = 5,
                             device: Optional[torch.device] = None) -> dict[str, float]:
    """Best-of-`iters` GB/s for reading a `size_mb` float32 tensor (sum) and copying it
    (counted as bytes read + bytes written)."""
    device = device or default_device()
    n = size_mb * (1 << 20) // 4
    x = torch.ones(n, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    read_s = _best_time(lambda: x.sum(), device, iters)
    copy_s = _best_time(lambda: y.copy_(x), device, iters)
    return {"read_gb_s": nbytes / read_s / 1e9, "copy_gb_s": 2 * nbytes / copy_s / 1e9,
            "size_mb": size_mb}


MATMUL_SHAPES = ((1, 2048, 2048), (16, 2048, 2048), (256, 2048, 2048), (2048, 2048, 2048))


def measure_matmul_flops(dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...] = MATMUL_SHAPES,
                         iters: int = 5, device: Optional[torch.device] = None) -> dict[str, float]:
    """Best-of-`iters` GFLOP/s of `a @ b` for each (M, K, N); key "MxKxN". On CPU the faster
    of torch.matmul and oneDNN with a prepacked weight (what kvserve's linear layers use:
    float32 torch.matmul is ~2x slower here, and a roofline below the engine is no roofline)."""
    from kvserve.ops.linear import pack_weight, packed_linear
    device = device or default_device()
    out = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        packed = pack_weight(b.t().contiguous())
        # About 4 GFLOP per timing, so small shapes are not all timer noise.
        reps = min(200, max(1, int(4e9 // (2 * m * k * n))))

        def run() -> None:
            for _ in range(reps):
                torch.matmul(a, b)

        def run_packed() -> None:
            for _ in range(reps):
                packed_linear(a, packed)

        t = _best_time(run, device, iters)
        if packed is not None:
            t = min(t, _best_time(run_packed, device, iters))
        out[f"{m}x{k}x{n}"] = 2 * m * k * n * reps / t / 1e9
    return out


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from kvserve.ops import cpu_isa
    flags = sorted(f for f in cpu_isa.cpu_flags()
                   if f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16"))
    desc = (f"{cpu} (flags: {' '.join(flags) or 'none of avx2/avx512'}), {os.cpu_count()} CPUs, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernel tier "
            f"{cpu_isa.selected_tier()}")
    if torch.cuda.is_available():
        desc += f", GPU {torch.cuda.get_device_name()}"
    return desc


# ---------------------------------------------------------------------------------------------
# Checkpoint arithmetic

def _safetensors_shapes(model_path: str) -> dict[str, list[int]]:
    """Tensor shapes from the safetensors headers, without loading any weights."""
    shapes: dict[str, list[int]] = {}
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_path} has no *.safetensors files.")
    for name in files:
        with open(os.path.join(model_path, name), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for key, info in header.items():
            if key != "__metadata__":
                shapes[key] = info["shape"]
    return shapes


def load_hf_config(model_path: str) -> dict[str, Any]:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


def decode_param_count(model_path: str) -> dict[str, int]:
    """Parameters in the checkpoint, and those one decode step reads: all but the input
    embedding table (unless it doubles as the output layer, tied)."""
    shapes = _safetensors_shapes(model_path)
    numel = {k: int(torch.Size(s).numel()) for k, s in shapes.items()}
    total = sum(numel.values())
    embed = sum(v for k, v in numel.items() if k.endswith("embed_tokens.weight"))
    tied = bool(load_hf_config(model_path).get("tie_word_embeddings", False)) \
        and not any(k.startswith("lm_head") for k in numel)
    return {"total": total, "embedding": embed, "decode": total if tied else total - embed}


def dtype_of(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"Unknown dtype {name!r}; choose one of {', '.join(table)}.")
    return table[name]


def kv_cache_bytes_for(model_path: str, dtype: str, token_counts: list[int],
                       block_size: int = 16) -> int:
    """KV cache bytes that hold every sequence of `token_counts` at once (whole blocks,
    one spare block each)."""
    cfg = load_hf_config(model_path)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    per_token = 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim \
        * torch.tensor([], dtype=dtype_of(dtype)).element_size()
    blocks = sum(-(-n // block_size) + 1 for n in token_counts)
    return blocks * block_size * per_token


def roofline_limits(model_path: str, dtype: str, bandwidth_gb_s: float,
                    peak_gflop_s: float) -> dict[str, float]:
    params = decode_param_count(model_path)
    weight_bytes = params["decode"] * torch.tensor([], dtype=dtype_of(dtype)).element_size()
    return {
        "decode_params": params["decode"], "total_params": params["total"],
        "weight_bytes": weight_bytes,
        "batch1_decode_limit_tok_s": bandwidth_gb_s * 1e9 / weight_bytes,
        "compute_limit_tok_s": peak_gflop_s * 1e9 / (2 * params["decode"]),
    }


# ---------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import LLM
    from kvserve.benchmarks.latency import measure_decode_throughput

    model = args.model or ensure_bench_model(args.model_dir)
    device = default_device()
    bw = measure_memory_bandwidth(device=device)
    result: dict[str, Any] = {"machine": machine_description(), "model": model,
                              "memory_bandwidth": bw, "dtypes": {}}
    print(f"Machine: {result['machine']}")
    print(f"Memory bandwidth: read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s")
    for dtype in args.dtypes:
        flops = measure_matmul_flops(dtype_of(dtype), device=device)
        peak = max(flops.values())
        limits = roofline_limits(model, dtype, bw["read_gb_s"], peak)
        entry: dict[str, Any] = {"matmul_gflop_s": flops, "peak_gflop_s": peak, **limits}
        print(f"\n[{dtype}] matmul GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in flops.items()))
        print(f"[{dtype}] decode reads {limits['weight_bytes'] / 1e6:.0f} MB of weights per step "
              f"({limits['decode_params'] / 1e6:.1f}M parameters)")
        print(f"[{dtype}] limits: batch-1 decode {limits['batch1_decode_limit_tok_s']:.0f} tok/s "
              f"(bandwidth), large batch {limits['compute_limit_tok_s']:.0f} tok/s (compute)")
        if not args.skip_kvserve:
            ctx = args.prompt_len + args.decode_tokens + 1
            llm = LLM(model, dtype=dtype, max_model_len=ctx + 16, max_num_seqs=args.large_batch,
                      enable_prefix_caching=False,
                      kv_cache_memory=kv_cache_bytes_for(model, dtype, [ctx] * args.large_batch))
            try:
                for key, batch in (("batch1", 1), ("large_batch", args.large_batch)):
                    m = measure_decode_throughput(llm, batch, args.prompt_len, args.decode_tokens,
                                                  num_iters=args.num_iters)
                    bound = min(batch * limits["batch1_decode_limit_tok_s"],
                                limits["compute_limit_tok_s"])
                    entry[f"kvserve_{key}_decode_tok_s"] = m["decode_tokens_per_second"]
                    entry[f"kvserve_{key}_fraction_of_bandwidth_limit"] = \
                        m["decode_tokens_per_second"] / (batch * limits["batch1_decode_limit_tok_s"])
                    entry[f"kvserve_{key}_fraction_of_compute_limit"] = \
                        m["decode_tokens_per_second"] / limits["compute_limit_tok_s"]
                    entry[f"kvserve_{key}_fraction_of_roofline"] = m["decode_tokens_per_second"] / bound
                    print(f"[{dtype}] kvserve batch {batch:>3} decode: "
                          f"{m['decode_tokens_per_second']:8.1f} tok/s = "
                          f"{100 * m['decode_tokens_per_second'] / bound:5.1f}% of its roofline "
                          f"{bound:.0f} tok/s ({m['step_time_ms']:.1f} ms/step)")
            finally:
                llm.shutdown()
        result["dtypes"][dtype] = entry
    return result


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the ~110M Llama).")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                   help="Where the default benchmark model is built and cached.")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--large-batch", type=int, default=64, help="Batch size of the large-batch run.")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64, help="Decode steps timed per run.")
    p.add_argument("--num-iters", type=int, default=3, help="Best of this many runs.")
    p.add_argument("--skip-kvserve", action="store_true", help="Only measure the machine.")
    p.add_argument("--output-json", default=None)
    return p


def write_json(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def bench_main(make_parser: Callable[[], argparse.ArgumentParser],
               run: Callable[[argparse.Namespace], dict[str, Any]],
               argv: Optional[list[str]] = None) -> int:
    """A benchmark script's main: parse, run, write the result to --output-json if given."""
    args = make_parser().parse_args(argv)
    result = run(args)
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return bench_main(make_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
