"""Pipeline and data parallelism on one machine: what they cost (issue 11).

On the ~110M benchmark Llama (benchmarks/.models, built once), float32, greedy, EOS ignored,
one run, each configuration back to back with the same requests:
- PP=1 (one process, all threads) vs PP=2 (two worker processes, threads split between them)
  at the same total cores; PP=2 with and without the batch queue (without: the engine core
  waits for each batch before scheduling the next);
- DP=1 vs DP=2 engine cores behind one AsyncLLM (threads split between the engines);
- a per-step timeline of the two PP stages (execute_model start/end on each rank).
On a 2-core machine these measure overheads, not speed-ups.

    python benchmarks/parallel.py [--num-prompts 32] [--output-len 32] [--output-json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import DEFAULT_MODEL_DIR, ensure_bench_model, machine_description  # noqa: E402

from kvserve.engine.arg_utils import EngineArgs  # noqa: E402
from kvserve.engine.async_llm import AsyncLLM  # noqa: E402
from kvserve.entrypoints.llm import LLM  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402

ENGINE_KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=256 << 20)


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 700) for _ in range(rng.randint(32, 256))] for _ in range(n)]


def run_llm(model: str, prompts: list, params: SamplingParams, batch_queue: bool = True,
            timeline: bool = False, **kw: Any) -> dict[str, Any]:
    with LLM(model, multiprocessing=False, **ENGINE_KW, **kw) as llm:
        engine = llm.llm_engine.engine_core.engine_core
        if not batch_queue:
            engine.batch_queue = None           # one batch at a time: step() waits for each
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        if timeline:
            engine.model_executor.collective_rpc("record_timeline", (True,))
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        result = {"seconds": elapsed,
                  "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed}
        if timeline:
            result["timeline"] = engine.model_executor.collective_rpc("record_timeline", (False,))
    return result


async def _run_async(llm: AsyncLLM, prompts: list, params: SamplingParams) -> int:
    async def one(i: int, p: list) -> int:
        n = 0
        async for out in llm.generate({"prompt_token_ids": p}, params, request_id=f"r{i}"):
            n = len(out.outputs[0].token_ids)
        return n
    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def run_dp(model: str, prompts: list, params: SamplingParams, dp: int) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        llm = AsyncLLM.from_engine_args(EngineArgs(model=model, data_parallel_size=dp, **ENGINE_KW))
        try:
            await _run_async(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))
            start = time.perf_counter()
            tokens = await _run_async(llm, prompts, params)
            elapsed = time.perf_counter() - start
        finally:
            llm.shutdown()
        return {"seconds": elapsed, "output_tok_s": tokens / elapsed}
    return asyncio.run(main())


def describe_timeline(timeline: list[list[tuple[float, float]]], steps: int = 12) -> list[str]:
    """The first `steps` steps of each stage, in ms from the first start; and how much of
    stage 1's busy time overlapped stage 0's."""
    t0 = min(t[0][0] for t in timeline if t)
    lines = []
    for rank, spans in enumerate(timeline):
        shown = " ".join(f"[{(a - t0) * 1e3:.0f}-{(b - t0) * 1e3:.0f}]" for a, b in spans[:steps])
        lines.append(f"stage {rank}: {shown}")
    busy0 = [(a, b) for a, b in timeline[0]]
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in timeline[1] for c, d in busy0)
    busy1 = sum(b - a for a, b in timeline[1])
    lines.append(f"stage 1 busy {busy1:.2f} s, of which {overlap:.2f} s overlapped stage 0")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="small enough that the requests spread over several batches (the "
                        "batch queue has something to overlap)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    model = args.model or ensure_bench_model(args.model_dir)
    prompts = make_prompts(args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    kw = dict(max_num_batched_tokens=args.max_num_batched_tokens)
    results: dict[str, Any] = {"machine": machine_description()}
    results["pp1"] = run_llm(model, prompts, params, **kw)
    results["pp2_batch_queue"] = run_llm(model, prompts, params, pipeline_parallel_size=2,
                                         timeline=True, **kw)
    results["pp2_no_batch_queue"] = run_llm(model, prompts, params, batch_queue=False,
                                            pipeline_parallel_size=2, **kw)
    results["dp1"] = run_dp(model, prompts, params, 1)
    results["dp2"] = run_dp(model, prompts, params, 2)
    timeline = results["pp2_batch_queue"].pop("timeline")
    print(results["machine"])
    print(f"{args.num_prompts} requests x {args.output_len} output tokens, prompts 32..256, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}, float32")
    for name in ("pp1", "pp2_batch_queue", "pp2_no_batch_queue", "dp1", "dp2"):
        r = results[name]
        print(f"{name:20s} {r['seconds']:7.2f} s  {r['output_tok_s']:7.1f} output tok/s")
    print("\n".join(describe_timeline(timeline)))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(results, timeline=timeline), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
