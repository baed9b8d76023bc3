"""Beam search cost: `LLM.beam_search` (width --beam-width) against plain greedy `generate`
of the same length, on one engine, interleaved, best of --iters.

Printed per mode: seconds for one prompt's --output-len tokens, output tokens/s of the
returned best sequence, and the tokens the engine computed (prefix-cache misses from the
engine's stats, plus greedy's decode tokens): with prefix caching a beam's step recomputes only
the tokens after its last full KV block, about beam_width x block_size / 2 per step, whatever
the sequence length.

    python benchmarks/beam_search.py [--model demo] [--beam-width 4] [--prompt-len 32]
        [--output-len 32] [--iters 3] [--output-json f]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from kvserve import LLM, BeamSearchParams, SamplingParams


def _computed(llm: LLM, before: dict[str, Any]) -> int:
    after = llm.get_stats()
    return ((after["prefix_cache_queries"] - before["prefix_cache_queries"])
            - (after["prefix_cache_hits"] - before["prefix_cache_hits"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    llm = LLM(args.model, max_model_len=512, seed=0)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    results: dict[str, dict[str, float]] = {}
    best: dict[str, float] = {"greedy": float("inf"), "beam": float("inf")}
    computed: dict[str, int] = {}
    for it in range(args.iters + 1):       # iteration 0 warms up
        prompt = [rng.randrange(100, vocab - 1) for _ in range(args.prompt_len)]
        for mode in ("greedy", "beam"):
            llm.reset_prefix_cache()
            before = llm.get_stats()
            t0 = time.perf_counter()
            if mode == "greedy":
                llm.generate({"prompt_token_ids": prompt},
                             SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                            ignore_eos=True), use_tqdm=False)
            else:
                llm.beam_search(prompt, BeamSearchParams(beam_width=args.beam_width,
                                                         max_tokens=args.output_len,
                                                         ignore_eos=True))
            elapsed = time.perf_counter() - t0
            # Prompt tokens that missed the prefix cache, plus greedy's decode steps (a beam
            # step is a new request: its tokens are all counted as prompt tokens).
            computed[mode] = _computed(llm, before) + (args.output_len - 1 if mode == "greedy"
                                                       else 0)
            if it > 0:
                best[mode] = min(best[mode], elapsed)
    for mode in ("greedy", "beam"):
        results[mode] = {"seconds": best[mode], "output_tokens_per_s": args.output_len / best[mode],
                         "tokens_computed": computed[mode]}
        print(f"{mode:6s} {best[mode]:7.3f} s  {args.output_len / best[mode]:7.1f} tok/s  "
              f"{computed[mode]} tokens computed")
    print(f"beam search (width {args.beam_width}) / greedy time: "
          f"{best['beam'] / best['greedy']:.2f}x")
    llm.shutdown()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
