"""What the engine core's per-step messages cost at batch 1: offline `LLM.generate` with the
engine core in-process, in its own process (the default: a final-only request's step outputs
are held, engine/output_coalescer.py), in its own process sending every step
(KVSERVE_HOLD_OUTPUTS=0, the behaviour before), and with stats on (which also sends every step).

The engines live side by side in one process and take turns, in a shuffled order each round, on
fresh random prompts; each round's time is divided by the in-process engine's time of the same
round, and the median of those ratios is reported with its 95% confidence interval
(spec_decode.median_ci95), since this host's memory bandwidth drifts by tens of % within
minutes.

    python benchmarks/output_hold.py [--rounds 30] [--prompt-len 64] [--max-tokens 129]
                                     [--output-json out.json]

KVSERVE_CPU_ISA=avx2 runs the kernels of the avx2 tier (issue 16's comparisons).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvserve import LLM, SamplingParams  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import (ensure_bench_model, ensure_checkpoint_as, machine_description,  # noqa: E402
                      write_json)
from spec_decode import median_ci95  # noqa: E402


def make_engines(model: str) -> dict[str, LLM]:
    kw: dict[str, Any] = dict(dtype="auto", max_model_len=1024, max_num_seqs=4, seed=0)
    engines = {"in-process": LLM(model, multiprocessing=False, **kw),
               "held (default)": LLM(model, **kw),
               "stats on": LLM(model, disable_log_stats=False, **kw)}
    # The engine core process reads the switch when it starts.
    os.environ["KVSERVE_HOLD_OUTPUTS"] = "0"
    try:
        engines["every step"] = LLM(model, **kw)
    finally:
        del os.environ["KVSERVE_HOLD_OUTPUTS"]
    return engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=129)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    model = ensure_checkpoint_as(ensure_bench_model(), "bfloat16")
    engines = make_engines(model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for _ in range(args.rounds):
            order = list(engines)
            rng.shuffle(order)
            for name in order:
                prompt = [{"prompt_token_ids": [rng.randrange(100, 32000)
                                                for _ in range(args.prompt_len)]}]
                start = time.perf_counter()
                engines[name].generate(prompt, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
    finally:
        for llm in engines.values():
            llm.shutdown()
    result: dict[str, Any] = {"machine": machine_description(), "args": vars(args),
                              "isa": os.environ.get("KVSERVE_CPU_ISA", "default"), "engines": {}}
    print(f"| engine | median ms per request ({args.max_tokens} tokens) | / in-process (95% CI) |")
    print("|---|---|---|")
    for name, ts in times.items():
        ratios = [t / ref for t, ref in zip(ts, times["in-process"])]
        ci = median_ci95(ratios)
        entry = {"median_s": statistics.median(ts), "ratio_median": statistics.median(ratios),
                 "ratio_ci95": ci, "times_s": ts}
        result["engines"][name] = entry
        ci_text = f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else ""
        print(f"| {name} | {1e3 * entry['median_s']:.1f} | {entry['ratio_median']:.3f}{ci_text} |")
    if args.output_json:
        write_json(args.output_json, result)


if __name__ == "__main__":
    main()
