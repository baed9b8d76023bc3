"""Async scheduling on/off on the same machine, in alternating rounds (issue 31: on CPU it must
not slow anything). Not a test.

Two engines of one model (default: the demo model) in this process, one with
`async_scheduling=True`; each round times both, in alternating order:
- batch-1 decode: one prompt, `--batch1-tokens` greedy tokens (a 1-token run subtracted);
- offline: `--num-requests` random prompts of 32..128 tokens, `--output-len` tokens each.

    python benchmarks/async_scheduling.py [--model demo] [--rounds 3] [--num-requests 32]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kvserve import LLM, SamplingParams  # noqa: E402


def batch1_tok_s(llm: LLM, prompt: list[int], n: int) -> float:
    p = {"prompt_token_ids": prompt}
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t = time.perf_counter(); llm.generate(p, one, use_tqdm=False); t1 = time.perf_counter() - t
    t = time.perf_counter(); llm.generate(p, many, use_tqdm=False); tn = time.perf_counter() - t
    return (n - 1) / (tn - t1)


def offline_tok_s(llm: LLM, prompts: list[dict], out_len: int) -> float:
    sp = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch1-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    engines = {a: LLM(args.model, max_model_len=512, multiprocessing=False, seed=0,
                      async_scheduling=a) for a in (False, True)}
    vocab = 1000
    prompts = [{"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(rng.randint(32, 128))]}
               for _ in range(args.num_requests)]
    b1_prompt = prompts[0]["prompt_token_ids"]
    res: dict[bool, dict[str, list[float]]] = {a: {"b1": [], "off": []} for a in engines}
    for a, llm in engines.items():   # warm-up; outputs must agree
        outs = [o.outputs[0].token_ids for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False)]
        res[a]["warm"] = outs
    assert res[False].pop("warm") == res[True].pop("warm"), "async changed the outputs"
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for a in order:
            res[a]["b1"].append(batch1_tok_s(engines[a], b1_prompt, args.batch1_tokens))
            res[a]["off"].append(offline_tok_s(engines[a], prompts, args.output_len))
        print(f"round {r}: " + ", ".join(
            f"async={a}: batch-1 {res[a]['b1'][-1]:.1f} tok/s, offline {res[a]['off'][-1]:.1f} "
            f"tok/s" for a in order), flush=True)
    summary: dict[str, Any] = {}
    for key, label in (("b1", "batch-1 decode"), ("off", f"offline {args.num_requests} req")):
        off, on = (statistics.median(res[a][key]) for a in (False, True))
        summary[key] = (off, on)
        print(f"{label}: async off {off:.1f} tok/s, on {on:.1f} tok/s (median of "
              f"{args.rounds}): {on / off - 1:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
