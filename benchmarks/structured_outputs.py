"""Structured outputs: what constraining costs, and what jump-forward decoding saves.

Measures, on the ~110M-parameter Llama of roofline.py (vocab 32000, float32 by default):
- decode throughput (output tokens/s) of a batch of 64 requests with 0%, 50% and 100% of them
  constrained by a JSON schema, back to back in one process (best of --repeats);
- grammar compile time p50 / p99 over a set of schemas: cold (each schema new to the
  compiler) and cached (the manager's (kind, spec) cache), plus the one-off tokenizer info;
- time per engine step spent on masks: filling the batch bitmask in the engine core and
  applying it to the logits in the runner;
- jump-forward decoding on a schema with long fixed keys: wall time and engine steps for the
  same batch with `enable_jump_forward` off and on.

    python benchmarks/structured_outputs.py [--model PATH] [--batch 64] [--max-tokens 48]
                                            [--dtype float32] [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.roofline import ensure_bench_model  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.sampling_params import StructuredOutputsParams  # noqa: E402
from kvserve.structured_output.manager import StructuredOutputManager  # noqa: E402
from kvserve.worker.model_runner import ModelRunner  # noqa: E402

# Open strings: a random model keeps writing until max_tokens, so every row decodes the same
# number of steps whether constrained or not.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["title", "count", "tags"]}
LONG_KEYS_SCHEMA = {"type": "object", "properties": {
    f"the_rather_long_property_name_number_{i}_of_the_record": {"enum": ["a", "b"]}
    for i in range(6)}, "additionalProperties": False}
LONG_KEYS_SCHEMA["required"] = list(LONG_KEYS_SCHEMA["properties"])


class Timers:
    """Wall time of the two mask functions, summed over a run (wrapping the methods)."""

    def __init__(self) -> None:
        self.fill = self.apply = 0.0
        self.steps = 0
        fill, apply = StructuredOutputManager.grammar_bitmask, ModelRunner._apply_grammar_bitmask

        def timed_fill(mgr: Any, *a: Any) -> Any:
            t = time.perf_counter()
            out = fill(mgr, *a)
            self.fill += time.perf_counter() - t
            self.steps += out[0] is not None
            return out

        def timed_apply(*a: Any) -> Any:
            t = time.perf_counter()
            out = apply(*a)
            self.apply += time.perf_counter() - t
            return out

        StructuredOutputManager.grammar_bitmask = timed_fill  # type: ignore[method-assign]
        ModelRunner._apply_grammar_bitmask = staticmethod(timed_apply)  # type: ignore[assignment]

    def reset(self) -> None:
        self.fill = self.apply = 0.0
        self.steps = 0


def _prompts(batch: int) -> list[dict]:
    return [{"prompt_token_ids": [100 + (i * 37 + j * 11) % 20000 for j in range(32)]}
            for i in range(batch)]


def _params(batch: int, ratio: float, max_tokens: int, schema: dict) -> list[SamplingParams]:
    n_con = round(batch * ratio)
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                           structured_outputs=so if i < n_con else None) for i in range(batch)]


def _run(llm: LLM, prompts: list, params: list) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def bench_throughput(llm: LLM, timers: Timers, args: argparse.Namespace) -> dict:
    prompts = _prompts(args.batch)
    _run(llm, prompts, _params(args.batch, 1.0, 4, SCHEMA))    # warm-up, grammar compiled
    results: dict[str, Any] = {}
    for _ in range(args.repeats):
        for ratio in (0.0, 0.5, 1.0):
            timers.reset()
            wall, tokens = _run(llm, prompts, _params(args.batch, ratio, args.max_tokens, SCHEMA))
            r = results.setdefault(f"{int(ratio * 100)}%", {"tok_s": 0.0})
            if tokens / wall > r["tok_s"]:
                r.update(tok_s=tokens / wall, tokens=tokens, wall_s=wall,
                         mask_fill_ms_per_step=1e3 * timers.fill / max(timers.steps, 1),
                         mask_apply_ms_per_step=1e3 * timers.apply / max(timers.steps, 1),
                         step_ms=1e3 * wall / max(timers.steps, 1) if timers.steps else None)
    base = results["0%"]["tok_s"]
    for r in results.values():
        r["vs_unconstrained"] = r["tok_s"] / base
    return results


def _schemas(n: int, salt: str) -> list[dict]:
    out = []
    for i in range(n):
        props = {f"{salt}_field_{i}_{j}": ({"type": "string", "maxLength": 5 + j} if j % 3 == 0
                 else {"type": "integer", "minimum": 0, "maximum": 10 ** j} if j % 3 == 1
                 else {"type": "array", "items": {"enum": ["x", "y", str(j)]}})
                 for j in range(3 + i % 6)}
        out.append({"type": "object", "properties": props, "required": list(props)})
    return out


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def bench_compile(llm: LLM, n: int) -> dict:
    mgr: StructuredOutputManager = llm.llm_engine.engine_core.engine_core.structured_output_manager
    backend = mgr.backend
    cold, cached = [], []
    for schema in _schemas(n, salt=f"s{time.time_ns()}"):
        t = time.perf_counter()
        backend.compile_grammar("json", (json.dumps(schema), False))
        cold.append(time.perf_counter() - t)
    from kvserve.core.request import Request
    for schema in _schemas(n, salt="cache")[:1] * n:
        req = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
        t = time.perf_counter()
        mgr.grammar_init(req)
        while not mgr.take_ready(req):
            time.sleep(0)
        cached.append(time.perf_counter() - t)
        mgr.drop(req)
    cached = cached[1:]     # the first one compiled it
    ms = lambda x: round(1e3 * x, 3)  # noqa: E731
    return {"schemas": n, "cold_p50_ms": ms(_pct(cold, 50)), "cold_p99_ms": ms(_pct(cold, 99)),
            "cached_p50_ms": ms(_pct(cached, 50)), "cached_p99_ms": ms(_pct(cached, 99))}


def bench_jump_forward(model: str, args: argparse.Namespace) -> dict:
    prompts = _prompts(args.batch)
    params = _params(args.batch, 1.0, 200, LONG_KEYS_SCHEMA)
    out: dict[str, Any] = {}
    for jf in (False, True):
        llm = LLM(model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch,
                  multiprocessing=False, structured_outputs_config={"enable_jump_forward": jf})
        core = llm.llm_engine.engine_core.engine_core
        steps = [0]
        step = core.step

        def counted() -> Any:
            steps[0] += 1
            return step()
        core.step = counted  # type: ignore[method-assign]
        _run(llm, prompts[:2], params[:2])           # warm-up + compile
        best = None
        for _ in range(args.repeats):
            steps[0] = 0
            wall, tokens = _run(llm, prompts, params)
            if best is None or wall < best["wall_s"]:
                best = {"wall_s": wall, "tokens": tokens, "engine_steps": steps[0],
                        "tok_s": tokens / wall}
        outs = llm.generate(prompts[:4], params[:4], use_tqdm=False)
        # Outputs cut by max_tokens are unfinished JSON: judge the finished ones.
        done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
        best["finished_valid_json"] = f"{sum(_parses(t) for t in done)}/{len(done)}"
        out["on" if jf else "off"] = best
        llm.shutdown()
    out["speedup"] = out["off"]["wall_s"] / out["on"]["wall_s"]
    return out


def _parses(text: str) -> bool:
    try:
        json.loads(text, strict=False)
    except json.JSONDecodeError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-schemas", type=int, default=20)
    ap.add_argument("--skip-jump-forward", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    model = args.model or ensure_bench_model()
    timers = Timers()
    llm = LLM(model, dtype=args.dtype, max_model_len=1024, max_num_seqs=args.batch,
              multiprocessing=False)
    t = time.perf_counter()
    llm.llm_engine.engine_core.engine_core.structured_output_manager.backend  # tokenizer info
    result: dict[str, Any] = {"cpu": platform.processor() or platform.machine(),
                              "batch": args.batch, "dtype": args.dtype,
                              "backend_init_s": time.perf_counter() - t}
    result["throughput"] = bench_throughput(llm, timers, args)
    print(json.dumps(result["throughput"], indent=2), flush=True)   # partial results first
    result["compile"] = bench_compile(llm, args.num_schemas)
    print(json.dumps(result["compile"], indent=2), flush=True)
    llm.shutdown()
    if not args.skip_jump_forward:
        result["jump_forward"] = bench_jump_forward(model, args)
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
