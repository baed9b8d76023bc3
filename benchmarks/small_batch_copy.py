"""Decode step time of a float32 model with and without the plain weight copies that let small
batches use the small-batch linear kernel (KVSERVE_CPU_SMALL_BATCH_COPY=1 vs 0, see
kvserve.ops.linear.keep_small_batch_copies), in one run.

Each repetition runs both settings in fresh processes, one after the other (so that machine
noise hits both alike); per batch size B: B fresh 32-token prompts generating 1 and 1 + N tokens,
greedy, best of --iters each; the difference is N decode steps of batch B. Printed: median step
time over the repetitions and the ratio.

    python benchmarks/small_batch_copy.py [--batch-sizes 1 4 8 16] [--tokens 48] [--reps 3]
        [--iters 2] [--threads N] [--output-json out.json]

--threads 1 on a shared machine: two threads wait for each other whenever another process holds
the second core (each OpenMP region then costs a scheduler time slice).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = ("0", "1")


def measure(model: str, batch_sizes: list[int], tokens: int, iters: int) -> dict[str, float]:
    """Seconds per decode step for each batch size, in this process."""
    from kvserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=128, seed=0, kv_cache_memory=1 << 28)
    vocab = llm.get_tokenizer().vocab_size
    counter = iter(range(10**9))

    def run(batch: int, max_tokens: int) -> float:
        # Fresh prompts every call: no prefix-cache hit.
        prompts = [{"prompt_token_ids": [(7919 * next(counter) + 13 * j) % (vocab - 10) + 5
                                         for j in range(32)]} for _ in range(batch)]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                                detokenize=False)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    out = {}
    try:
        run(1, 4)                                                      # warm-up
        for b in batch_sizes:
            short = min(run(b, 1) for _ in range(iters))
            long = min(run(b, 1 + tokens) for _ in range(iters))
            out[str(b)] = (long - short) / tokens
    finally:
        llm.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="float32 checkpoint (default: the 110M Llama)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS for the engine (default: torch's, one per core)")
    p.add_argument("--output-json")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        with open(args.worker[1], "w") as f:
            json.dump(measure(args.worker[0], args.batch_sizes, args.tokens, args.iters), f)
        return
    sys.path.insert(0, HERE)
    from roofline import DEFAULT_MODEL_DIR, ensure_bench_model
    model = args.model or ensure_bench_model(DEFAULT_MODEL_DIR)
    steps: dict[str, dict[str, list[float]]] = {s: {} for s in SETTINGS}
    for rep in range(args.reps):
        for setting in SETTINGS:
            out = os.path.join(HERE, f".small_batch_copy-{os.getpid()}.json")
            cmd = [sys.executable, __file__, "--worker", model, out, "--batch-sizes",
                   *map(str, args.batch_sizes), "--tokens", str(args.tokens), "--iters",
                   str(args.iters)]
            env = {**os.environ, "KVSERVE_CPU_SMALL_BATCH_COPY": setting}
            if args.threads:    # torch reads it at start-up, in every process the engine starts
                env["OMP_NUM_THREADS"] = str(args.threads)
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                for b, s in json.load(f).items():
                    steps[setting].setdefault(b, []).append(s)
            os.unlink(out)
            print(f"rep {rep} copy={setting}: " + ", ".join(
                f"B={b} {v[-1] * 1e3:.1f} ms" for b, v in steps[setting].items()), flush=True)
    print(f"{'batch':>5} {'packed only ms':>15} {'+ plain copy ms':>16} {'speedup':>8}")
    result: list[dict[str, Any]] = []
    for b in map(str, args.batch_sizes):
        packed, both = (statistics.median(steps[s][b]) for s in SETTINGS)
        print(f"{b:>5} {packed * 1e3:>15.1f} {both * 1e3:>16.1f} {packed / both:>7.2f}x")
        result.append(dict(batch=int(b), packed_only_step_s=packed, with_copy_step_s=both,
                           packed_only_runs_s=steps["0"][b], with_copy_runs_s=steps["1"][b]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
