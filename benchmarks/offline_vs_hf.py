"""kvserve `LLM.generate` against Hugging Face `generate`, same model, same prompts, one run.

Issue 2's benchmark. The model is a random ~110M-parameter Llama (hidden 768, 12 layers,
12 heads, vocab 32000, intermediate 2048), built once under --model-dir. Per dtype
(bfloat16 and float32):

- 64 requests, prompt lengths uniform in 32..512 (random token ids), 128 output tokens each,
  greedy, EOS ignored;
- kvserve: all requests submitted to one `LLM.generate` call;
- Hugging Face: left-padded batches (sorted by prompt length: the least padding) of 8, 16
  and 32 prompts; the best batch size is the peer's number;
- output tokens/s of both and the ratio;
- batch-1 decode tokens/s (kvserve and Hugging Face, prefill excluded) against the bandwidth
  limit: memory read bandwidth / bytes of weights a decode step reads, the bandwidth read just
  before and just after kvserve's batch-1 run (their mean; the header's is the run's first).

dtype "auto" runs a bfloat16 copy of the checkpoint with dtype="auto" (what a user of a real
bf16 checkpoint gets): on a CPU without bf16 instructions its weights stay bf16 (the limit is
the 16-bit one) and the math and KV cache are float32. The kernels' ISA tier is the host's best
or KVSERVE_CPU_ISA's (issue 16: run once per tier).

Goals (issue 2): kvserve >= 4x Hugging Face in bfloat16, batch-1 bfloat16 decode >= 50% of
the bandwidth limit.

    python benchmarks/offline_vs_hf.py [--dtypes bfloat16 float32] [--num-prompts 64]
        [--output-len 128] [--hf-batch-sizes 8 16 32] [--output-json out.json]

Shrink it for a quick check with e.g. `--num-prompts 8 --output-len 16 --hf-batch-sizes 8`.
Absolute numbers drift on shared machines; the ratios of one run are what to compare.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import (DEFAULT_MODEL_DIR, decode_param_count, dtype_of,  # noqa: E402
                      ensure_bench_model, ensure_checkpoint_as, kv_cache_bytes_for, load_hf_config,
                      machine_description, measure_memory_bandwidth, roofline_limits,
                      write_json)

from kvserve.benchmarks.datasets import SampleRequest  # noqa: E402
from kvserve.benchmarks.throughput import load_hf_model, resolve_device, run_hf, run_kvserve  # noqa: E402

GOAL_RATIO_BF16 = 4.0
GOAL_BATCH1_FRACTION_BF16 = 0.5


def make_requests(num_prompts: int, min_len: int, max_len: int, output_len: int,
                  vocab_size: int, seed: int) -> list[SampleRequest]:
    """Prompt lengths uniform in [min_len, max_len]; token ids above the special ids."""
    rng = random.Random(seed)
    return [SampleRequest([rng.randrange(5, vocab_size) for _ in range(rng.randint(min_len, max_len))],
                          output_len) for _ in range(num_prompts)]


def hf_batch1_decode(model: Any, prompt_len: int, num_tokens: int, vocab_size: int,
                     num_iters: int = 2) -> float:
    """Hugging Face batch-1 decode tokens/s: generate 1 vs 1 + N tokens, best of num_iters."""
    device = next(model.parameters()).device
    ids = torch.randint(5, vocab_size, (1, prompt_len), device=device)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        return time.perf_counter() - start

    timed(2)
    short = min(timed(1) for _ in range(num_iters))
    long = min(timed(1 + num_tokens) for _ in range(num_iters))
    return num_tokens / max(long - short, 1e-9)


def bench_dtype(model: str, dtype: str, requests: list[SampleRequest],
                args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import LLM
    from kvserve.benchmarks.latency import measure_decode_throughput

    weights = dtype
    if dtype == "auto":     # a bf16 checkpoint, dtype="auto"; the KV cache may be float32
        model, weights = ensure_checkpoint_as(model, "bfloat16"), "bfloat16"
    vocab = int(load_hf_config(model)["vocab_size"])
    expected = sum(r.expected_output_len for r in requests)
    lens = [r.prompt_len + r.expected_output_len for r in requests]
    batch1_len = args.batch1_prompt_len + args.batch1_tokens + 1
    entry: dict[str, Any] = {}

    # kvserve: sized so that every request fits at once (no preemption).
    llm = LLM(model, dtype=dtype, max_model_len=max(lens + [batch1_len]) + 16,
              max_num_seqs=len(requests),
              kv_cache_memory=kv_cache_bytes_for(model, "float32" if dtype == "auto" else dtype,
                                                 lens + [batch1_len]),
              seed=args.seed)
    try:
        elapsed, out_lens = run_kvserve(requests, llm, temperature=0.0)
        if sum(out_lens) != expected:
            raise RuntimeError(f"kvserve produced {sum(out_lens)} tokens, expected {expected}")
        entry["kvserve_output_tok_s"] = expected / elapsed
        entry["kvserve_elapsed_s"] = elapsed
        entry["kvserve_num_preemptions"] = llm.get_stats()["num_preemptions"]
        # The limit from the bandwidth read just before and just after the batch-1 run: a
        # shared host's bandwidth moves by tens of % within minutes (benchmarks/README.md,
        # the Zen 4 run), so one reading at the start misplaced later dtypes' limits.
        before = measure_memory_bandwidth(args.bandwidth_mb)["read_gb_s"]
        b1 = measure_decode_throughput(llm, 1, args.batch1_prompt_len, args.batch1_tokens,
                                       num_iters=args.num_iters)
        after = measure_memory_bandwidth(args.bandwidth_mb)["read_gb_s"]
        entry["kvserve_batch1_decode_tok_s"] = b1["decode_tokens_per_second"]
        entry["read_gb_s_around_batch1"] = [before, after]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    print(f"[{dtype}] kvserve: {entry['kvserve_output_tok_s']:.1f} output tok/s "
          f"({elapsed:.1f} s); batch-1 decode {entry['kvserve_batch1_decode_tok_s']:.1f} tok/s",
          flush=True)

    if not args.skip_hf:
        hf = load_hf_model(model, dtype_of(weights), resolve_device("auto"))
        per_bs = {}
        for bs in args.hf_batch_sizes:
            elapsed, out_lens = run_hf(requests, hf, bs)
            if sum(out_lens) != expected:
                raise RuntimeError(f"HF produced {sum(out_lens)} tokens, expected {expected}")
            per_bs[str(bs)] = expected / elapsed
            print(f"[{dtype}] Hugging Face batch {bs}: {per_bs[str(bs)]:.1f} output tok/s "
                  f"({elapsed:.1f} s)", flush=True)
        entry["hf_output_tok_s_by_batch_size"] = per_bs
        best = max(per_bs, key=per_bs.get)
        entry["hf_best_batch_size"] = int(best)
        entry["hf_output_tok_s"] = per_bs[best]
        entry["ratio"] = entry["kvserve_output_tok_s"] / per_bs[best]
        entry["hf_batch1_decode_tok_s"] = hf_batch1_decode(
            hf, args.batch1_prompt_len, args.batch1_tokens, vocab, args.num_iters)
        del hf
        gc.collect()

    bandwidth_gb_s = sum(entry["read_gb_s_around_batch1"]) / 2
    limits = roofline_limits(model, weights, bandwidth_gb_s, peak_gflop_s=float("nan"))
    entry["weight_bytes"] = limits["weight_bytes"]
    entry["batch1_decode_limit_tok_s"] = limits["batch1_decode_limit_tok_s"]
    entry["kvserve_batch1_fraction_of_limit"] = \
        entry["kvserve_batch1_decode_tok_s"] / limits["batch1_decode_limit_tok_s"]
    return entry


def format_report(result: dict[str, Any]) -> str:
    lines = [f"Machine: {result['machine']}",
             f"Model: {result['model']} ({result['params_total'] / 1e6:.1f}M parameters, "
             f"{result['params_decode'] / 1e6:.1f}M read per decode step)",
             f"Workload: {result['num_prompts']} requests, prompts {result['prompt_len_range']}, "
             f"{result['output_len']} output tokens each, greedy, EOS ignored",
             f"Memory read bandwidth: {result['memory_bandwidth']['read_gb_s']:.1f} GB/s at the "
             f"start; each limit is from the reads around its batch-1 run", "",
             "| dtype | kvserve out tok/s | HF out tok/s (best bs) | ratio | kvserve batch-1 tok/s "
             "| HF batch-1 tok/s | read GB/s (before / after) | bandwidth limit | batch-1 / limit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dtype, e in result["dtypes"].items():
        hf = (f"{e['hf_output_tok_s']:.1f} ({e['hf_best_batch_size']})"
              if "hf_output_tok_s" in e else "-")
        ratio = f"{e['ratio']:.2f}x" if "ratio" in e else "-"
        hf1 = f"{e['hf_batch1_decode_tok_s']:.1f}" if "hf_batch1_decode_tok_s" in e else "-"
        lines.append(f"| {dtype} | {e['kvserve_output_tok_s']:.1f} | {hf} | {ratio} | "
                     f"{e['kvserve_batch1_decode_tok_s']:.1f} | {hf1} | "
                     f"{e['read_gb_s_around_batch1'][0]:.1f} / "
                     f"{e['read_gb_s_around_batch1'][1]:.1f} | "
                     f"{e['batch1_decode_limit_tok_s']:.0f} | "
                     f"{100 * e['kvserve_batch1_fraction_of_limit']:.0f}% |")
    bf = result["dtypes"].get("bfloat16")
    if bf:
        lines.append("")
        if "ratio" in bf:
            ok = "met" if bf["ratio"] >= GOAL_RATIO_BF16 else "NOT met"
            lines.append(f"Goal: bfloat16 throughput >= {GOAL_RATIO_BF16:.0f}x Hugging Face: "
                         f"{bf['ratio']:.2f}x, {ok}")
        ok = "met" if bf["kvserve_batch1_fraction_of_limit"] >= GOAL_BATCH1_FRACTION_BF16 else "NOT met"
        lines.append(f"Goal: bfloat16 batch-1 decode >= {100 * GOAL_BATCH1_FRACTION_BF16:.0f}% of "
                     f"the bandwidth limit: {100 * bf['kvserve_batch1_fraction_of_limit']:.0f}%, {ok}")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="Checkpoint directory to use instead of the ~110M benchmark Llama.")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                   help="Where the benchmark model is built once and cached.")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--skip-hf", action="store_true", help="Run kvserve only.")
    p.add_argument("--batch1-prompt-len", type=int, default=32)
    p.add_argument("--batch1-tokens", type=int, default=64, help="Decode steps timed at batch 1.")
    p.add_argument("--num-iters", type=int, default=3, help="Batch-1 runs: best of this many.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mb", type=int, default=512,
                   help="Size of the tensor read to measure memory bandwidth.")
    p.add_argument("--output-json", default=None)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        raise SystemExit("need 1 <= --min-prompt-len <= --max-prompt-len")
    model = args.model or ensure_bench_model(args.model_dir)
    params = decode_param_count(model)
    vocab = int(load_hf_config(model)["vocab_size"])
    requests = make_requests(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                             args.output_len, vocab, args.seed)
    bw = measure_memory_bandwidth(args.bandwidth_mb)
    result: dict[str, Any] = {
        "machine": machine_description(), "model": model, "params_total": params["total"],
        "params_decode": params["decode"], "num_prompts": args.num_prompts,
        "prompt_len_range": [args.min_prompt_len, args.max_prompt_len],
        "output_len": args.output_len, "memory_bandwidth": bw, "dtypes": {}}
    for dtype in args.dtypes:
        result["dtypes"][dtype] = bench_dtype(model, dtype, requests, args)
    print()
    print(format_report(result))
    if args.output_json:
        write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
