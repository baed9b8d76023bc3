"""`kvserve bench latency`: the latency of one fixed batch, as `vllm bench latency` measures it.

A batch of `--batch-size` random prompts of `--input-len` tokens, each generating exactly
`--output-len` tokens (`ignore_eos`), is run `--num-iters-warmup` times untimed and
`--num-iters` times timed. Reported: `avg_latency`, `std_latency`, every latency and the
p10/25/50/75/90/99 `percentiles` (seconds), with vLLM's JSON keys.

Unlike vLLM, every iteration gets fresh prompts: re-sending the same prompts would be served
from the prefix cache after the first iteration and hide the prefill.

The module also has the decode / prefill speed probes that the roofline and peer benchmarks
share (`measure_decode_throughput`, `measure_prefill_throughput`).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

from kvserve.benchmarks.datasets import sample_random_requests
from kvserve.engine.arg_utils import EngineArgs
from kvserve.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def _prompt_vocab(llm: Any) -> tuple[int, list[int]]:
    """Token ids valid for both the model and its tokenizer, and the special ids to avoid."""
    tokenizer = llm.get_tokenizer()
    model_vocab = llm.llm_engine.config.model_config.vocab_size
    return min(model_vocab, tokenizer.vocab_size), tokenizer.all_special_ids


def random_token_prompts(llm: Any, num_prompts: int, prompt_len: int,
                         seed: int) -> list[dict[str, Any]]:
    """`num_prompts` fresh random token-id prompts of exactly `prompt_len` tokens."""
    vocab, special = _prompt_vocab(llm)
    reqs = sample_random_requests(num_prompts, prompt_len, 1, vocab, 0.0, seed, special)
    return [r.to_engine_prompt() for r in reqs]


def _timed_generate(llm: Any, prompts: list[dict[str, Any]],
                    params: SamplingParams) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def run_latency(llm: Any, batch_size: int = 8, input_len: int = 32, output_len: int = 128,
                n: int = 1, num_iters_warmup: int = 10, num_iters: int = 30,
                detokenize: bool = True, seed: int = 0) -> dict[str, Any]:
    """Time `num_iters` runs of one batch; return vLLM's latency result dict plus extras."""
    for name, value in (("batch_size", batch_size), ("input_len", input_len),
                        ("output_len", output_len), ("n", n), ("num_iters", num_iters)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")
    if num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be >= 0, got {num_iters_warmup}.")
    # vLLM's settings: random sampling (n > 1 needs it), exactly output_len tokens each.
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, ignore_eos=True,
                            max_tokens=output_len, detokenize=detokenize)
    for i in range(num_iters_warmup):
        llm.generate(random_token_prompts(llm, batch_size, input_len, seed + i), params,
                     use_tqdm=False)
    latencies, output_tokens = [], []
    for i in range(num_iters):
        prompts = random_token_prompts(llm, batch_size, input_len,
                                       seed + num_iters_warmup + i)
        elapsed, outputs = _timed_generate(llm, prompts, params)
        latencies.append(elapsed)
        output_tokens.append(sum(len(c.token_ids) for o in outputs for c in o.outputs))
    lat = np.array(latencies)
    return {
        "avg_latency": float(lat.mean()),
        "std_latency": float(lat.std()),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in PERCENTILES},
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "n": n,
        "num_iters": num_iters, "num_iters_warmup": num_iters_warmup,
        "num_output_tokens_per_iter": output_tokens,
        # Tokens generated per second of batch latency (prefill included).
        "output_tokens_per_second": float(np.mean(output_tokens) / lat.mean()),
    }


def measure_decode_throughput(llm: Any, batch_size: int = 1, prompt_len: int = 32,
                              num_decode_tokens: int = 64, num_iters: int = 3,
                              seed: int = 1000) -> dict[str, float]:
    """Steady-state decode speed of a batch, without its prefill.

    Times the batch generating 1 token (prefill + first token) and 1 + N tokens, each on
    fresh prompts of the same length (no prefix-cache hits), best of `num_iters`; the
    difference is N decode steps. Greedy, EOS ignored.
    """
    if num_decode_tokens < 1 or batch_size < 1 or num_iters < 1:
        raise ValueError("batch_size, num_decode_tokens and num_iters must be >= 1.")
    short = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, detokenize=False)
    long = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1 + num_decode_tokens,
                          detokenize=False)
    # One untimed run first: the first call pays for lazy initialisation.
    llm.generate(random_token_prompts(llm, batch_size, prompt_len, seed - 1), long,
                 use_tqdm=False)
    t_short, t_long = [], []
    for i in range(num_iters):
        t_short.append(_timed_generate(
            llm, random_token_prompts(llm, batch_size, prompt_len, seed + 2 * i), short)[0])
        elapsed, outputs = _timed_generate(
            llm, random_token_prompts(llm, batch_size, prompt_len, seed + 2 * i + 1), long)
        got = sum(len(o.outputs[0].token_ids) for o in outputs)
        if got != batch_size * (1 + num_decode_tokens):
            raise RuntimeError(f"expected {batch_size * (1 + num_decode_tokens)} tokens, got {got}")
        t_long.append(elapsed)
    decode_time = min(t_long) - min(t_short)
    if decode_time <= 0:
        raise RuntimeError("decode timing drowned in noise: raise num_decode_tokens or num_iters")
    return {
        "batch_size": batch_size, "prompt_len": prompt_len,
        "num_decode_tokens": num_decode_tokens,
        "decode_tokens_per_second": batch_size * num_decode_tokens / decode_time,
        "step_time_ms": 1000.0 * decode_time / num_decode_tokens,
        "prefill_plus_first_token_s": min(t_short),
    }


def measure_prefill_throughput(llm: Any, prompt_len: int = 512, num_iters: int = 3,
                               seed: int = 2000) -> dict[str, float]:
    """Prompt-processing speed of one prompt: prompt_len / time to its first token, best of
    `num_iters` fresh prompts (so the prefix cache never hits)."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1, detokenize=False)
    llm.generate(random_token_prompts(llm, 1, prompt_len, seed - 1), params, use_tqdm=False)
    times = [_timed_generate(llm, random_token_prompts(llm, 1, prompt_len, seed + i), params)[0]
             for i in range(num_iters)]
    return {"prompt_len": prompt_len, "prefill_tokens_per_second": prompt_len / min(times),
            "time_to_first_token_s": min(times)}


# ---------------------------------------------------------------------------------------------
# CLI

def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--input-len", type=int, default=32, help="Prompt length in tokens.")
    parser.add_argument("--output-len", type=int, default=128, help="Tokens generated per request.")
    parser.add_argument("--batch-size", type=int, default=8, help="Requests in the batch.")
    parser.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    parser.add_argument("--num-iters-warmup", type=int, default=10,
                        help="Untimed iterations before the timed ones.")
    parser.add_argument("--num-iters", type=int, default=30, help="Timed iterations.")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="Do not detokenize outputs (time the engine alone).")
    parser.add_argument("--output-json", type=str, default=None,
                        help="Write the results to this JSON file.")
    EngineArgs.add_cli_args(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.weights import weights_label
    from kvserve.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    max_len = args.input_len + args.output_len
    if engine_args.max_model_len is not None and engine_args.max_model_len < max_len:
        raise ValueError(f"max_model_len {engine_args.max_model_len} is smaller than "
                         f"input_len + output_len = {max_len}.")
    llm = LLM(**vars(engine_args))
    try:
        result = run_latency(llm, args.batch_size, args.input_len, args.output_len, args.n,
                             args.num_iters_warmup, args.num_iters,
                             detokenize=not args.disable_detokenize, seed=engine_args.seed)
        result["weights"] = weights_label(llm.llm_engine.config.model_config)
    finally:
        llm.shutdown()
    print(format_latency(result))
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def format_latency(result: dict[str, Any]) -> str:
    lines = [f"Avg latency: {result['avg_latency']:.4f} s  (std {result['std_latency']:.4f} s, "
             f"{result['num_iters']} iterations, batch {result['batch_size']}, "
             f"input {result['input_len']}, output {result['output_len']})"]
    lines += [f"{p}% percentile latency: {v:.4f} s" for p, v in result["percentiles"].items()]
    lines.append(f"Output tokens/s (batch): {result['output_tokens_per_second']:.1f}")
    if result.get("weights"):
        lines.append(f"Weights: {result['weights']}")
    return "\n".join(lines)


def write_json(path: str, result: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    import sys

    from kvserve.benchmarks.cli import main as _bench_main
    sys.exit(_bench_main(["latency", *sys.argv[1:]]))
