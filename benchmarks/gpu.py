"""The CUDA path against Hugging Face `generate` on one GPU (issue 10's benchmark). Not a test.

Model: a random 1B Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192,
vocab 8192), bfloat16, built once under --model-dir. In one run:

1. offline throughput: 256 requests, prompts uniform in 128..1024 random tokens, 256 output
   tokens each, greedy, EOS ignored; kvserve (TRITON_ATTN, CUDA graphs) in one LLM.generate
   vs HF `generate` on left-padded length-sorted batches of 32 and 64 (the best is the peer);
2. batch-1 decode tok/s (prefill excluded: a 1-token run subtracted) vs the bandwidth limit
   = measured device copy bandwidth / bytes of weights read per decode step;
3. TTFT of one 4096-token prompt (max_tokens=1);
4. the same throughput and batch-1 runs with enforce_eager=True (graphs off).

Goals on an H100: kvserve >= 12x HF throughput; batch-1 >= 60% of the bandwidth limit.

    python benchmarks/gpu.py [--num-prompts 256] [--output-len 256] [--hf-batch-sizes 32 64]
        [--attention-backend TRITON_ATTN] [--output-json results/gpu.json]

Shrink for a smoke run: --num-prompts 16 --output-len 32 --hf-batch-sizes 16.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
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
GOAL_RATIO, GOAL_BATCH1 = 12.0, 0.6


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


def run_kvserve_all(path: str, requests, args, enforce_eager: bool) -> dict[str, Any]:
    from kvserve import LLM, SamplingParams
    llm = LLM(path, dtype="bfloat16", device="cuda", enforce_eager=enforce_eager,
              attention_backend=args.attention_backend, max_model_len=8192,
              max_num_seqs=256, multiprocessing=False)
    elapsed, outs = run_kvserve(requests, llm)
    res = {"throughput_tok_s": sum(outs) / elapsed, "elapsed_s": elapsed,
           "batch1_tok_s": batch1_decode(llm, requests[0].prompt_token_ids, 128)}
    if not enforce_eager:
        long_prompt = {"prompt_token_ids": [random.Random(1).randrange(5, 8192)
                                            for _ in range(4096)]}
        one = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate(long_prompt, one, use_tqdm=False)           # warm-up
        llm.reset_prefix_cache()                                 # the timed run is no cache hit
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(long_prompt, one, use_tqdm=False)
        res["ttft_4k_ms"] = (time.perf_counter() - t) * 1e3
    del llm
    gc.collect(); torch.cuda.empty_cache()
    return res


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/kvserve/bench"))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-prompt-len", type=int, default=128)
    ap.add_argument("--max-prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--attention-backend", default="TRITON_ATTN")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU", file=sys.stderr)
        return 2
    path = ensure_random_checkpoint(MODEL_NAME, MODEL_CONFIG, args.model_dir)
    requests = make_requests(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                             args.output_len, MODEL_CONFIG["vocab_size"])
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "model": MODEL_CONFIG, "num_prompts": args.num_prompts}
    result["kvserve"] = run_kvserve_all(path, requests, args, enforce_eager=False)
    result["kvserve_enforce_eager"] = run_kvserve_all(path, requests, args, enforce_eager=True)
    hf = load_hf_model(path, torch.bfloat16, "cuda")
    result["hf"] = {}
    for b in args.hf_batch_sizes:
        elapsed, outs = run_hf(requests, hf, b)
        result["hf"][b] = sum(outs) / elapsed
    del hf
    gc.collect(); torch.cuda.empty_cache()
    bw = copy_bandwidth_gb_s()
    limit = bw * 1e9 / weight_bytes_per_decode(path)
    best_hf = max(result["hf"].values())
    kv = result["kvserve"]
    result.update(copy_bandwidth_gb_s=bw, batch1_limit_tok_s=limit,
                  ratio_vs_hf=kv["throughput_tok_s"] / best_hf,
                  batch1_fraction=kv["batch1_tok_s"] / limit,
                  graphs_speedup_batch1=kv["batch1_tok_s"]
                  / result["kvserve_enforce_eager"]["batch1_tok_s"])
    print(f"{result['device']}: kvserve {kv['throughput_tok_s']:.0f} tok/s vs HF best "
          f"{best_hf:.0f} ({result['ratio_vs_hf']:.1f}x, goal {GOAL_RATIO}x); batch-1 "
          f"{kv['batch1_tok_s']:.0f} tok/s = {result['batch1_fraction']:.0%} of "
          f"{limit:.0f} (copy {bw:.0f} GB/s; goal {GOAL_BATCH1:.0%}); TTFT 4k "
          f"{kv['ttft_4k_ms']:.0f} ms; enforce_eager batch-1 "
          f"{result['kvserve_enforce_eager']['batch1_tok_s']:.0f} tok/s")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
