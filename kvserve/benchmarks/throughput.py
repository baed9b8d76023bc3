"""`kvserve bench throughput`: offline throughput with every request submitted at once.

Backends, fed the same token ids from one dataset (`kvserve.benchmarks.datasets`):
- `kvserve`: `LLM.generate` on all prompts (engine flags as for `kvserve generate`).
- `hf`: Hugging Face `generate` on left-padded batches of `--hf-max-batch-size` prompts,
  sorted by prompt length first (the least padding: the peer's best case). A batch generates
  as many tokens as its longest request asks for; each request is credited with the tokens it
  asked for, since Hugging Face cannot stop one row of a batch early.

Both generate exactly each request's output length (`ignore_eos` / `min_new_tokens`) and are
greedy unless `--temperature` is given. One untimed warm-up request runs first on each.
Results use vLLM's keys (`elapsed_time`, `num_requests`, `total_num_tokens`,
`requests_per_second`, `tokens_per_second`) plus `output_tokens_per_second` and counts.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Any, Optional, Sequence

import torch

from kvserve.benchmarks.datasets import SampleRequest, add_dataset_args, get_samples
from kvserve.benchmarks.latency import write_json
from kvserve.engine.arg_utils import EngineArgs
from kvserve.sampling_params import SamplingParams

BACKENDS = ("kvserve", "hf")


def make_result(backend: str, elapsed: float, requests: Sequence[SampleRequest],
                output_lens: Sequence[int], n: int = 1,
                extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """vLLM's throughput result keys from the measured time and the tokens produced."""
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = int(sum(output_lens))
    total = prompt_tokens + output_tokens
    result = {
        "backend": backend,
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "n": n,
        "total_num_tokens": total,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    result.update(extra or {})
    return result


# ---------------------------------------------------------------------------------------------
# kvserve

def warmup_kvserve(llm: Any, token_id: int) -> None:
    """One tiny untimed request: pays for lazy initialisation. Shorter than a block, so it
    leaves nothing in the prefix cache."""
    llm.generate([{"prompt_token_ids": [token_id] * 4}],
                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)


def run_kvserve(requests: Sequence[SampleRequest], llm: Any, n: int = 1,
                temperature: float = 0.0, detokenize: bool = True,
                use_tqdm: bool = False, warmup: bool = True) -> tuple[float, list[int]]:
    """Submit every request to `llm.generate` at once; (elapsed seconds, output tokens per
    request, all n completions counted)."""
    params = [SamplingParams(n=n, temperature=temperature, top_p=1.0, ignore_eos=True,
                             max_tokens=r.expected_output_len, detokenize=detokenize)
              for r in requests]
    if warmup:
        warmup_kvserve(llm, requests[0].prompt_token_ids[-1])
    prompts = [r.to_engine_prompt() for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    return elapsed, [sum(len(c.token_ids) for c in o.outputs) for o in outputs]


# ---------------------------------------------------------------------------------------------
# Hugging Face

def load_hf_model(model_path: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    if os.path.isfile(model_path):       # GGUF: transformers dequantizes it itself
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(device).eval()


def run_hf(requests: Sequence[SampleRequest], model: Any, max_batch_size: int,
           pad_token_id: int = 0, n: int = 1, temperature: float = 0.0,
           warmup: bool = True) -> tuple[float, list[int]]:
    """Hugging Face `generate` on left-padded batches (sorted by prompt length); returns
    (elapsed seconds, output tokens credited per request)."""
    if max_batch_size < 1:
        raise ValueError(f"hf_max_batch_size must be >= 1, got {max_batch_size}.")
    device = next(model.parameters()).device
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        if temperature > 0 else {"do_sample": False})

    def generate(batch: Sequence[SampleRequest]) -> int:
        max_in = max(r.prompt_len for r in batch)
        max_out = max(r.expected_output_len for r in batch)
        input_ids = torch.full((len(batch), max_in), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max_in), dtype=torch.long)
        for row, r in enumerate(batch):      # left padding: prompts end at the same column
            input_ids[row, max_in - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[row, max_in - r.prompt_len:] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_out, min_new_tokens=max_out,
                                 num_return_sequences=n, pad_token_id=pad_token_id,
                                 use_cache=True, **sampling)
        return out.shape[1] - max_in

    if warmup:
        generate([SampleRequest(requests[0].prompt_token_ids[:4], 2)])
    order = sorted(range(len(requests)), key=lambda i: requests[i].prompt_len)
    output_lens = [0] * len(requests)
    start = time.perf_counter()
    for b in range(0, len(order), max_batch_size):
        idx = order[b:b + max_batch_size]
        produced = generate([requests[i] for i in idx])
        for i in idx:
            output_lens[i] = n * min(produced, requests[i].expected_output_len)
    elapsed = time.perf_counter() - start
    return elapsed, output_lens


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# ---------------------------------------------------------------------------------------------
# CLI

def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--backend", choices=BACKENDS, default="kvserve",
                        help="kvserve: LLM.generate; hf: Hugging Face transformers generate.")
    add_dataset_args(parser)
    parser.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="Sampling temperature for both backends (0 = greedy).")
    parser.add_argument("--hf-max-batch-size", type=int, default=32,
                        help="hf backend: prompts per generate() batch.")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="kvserve backend: do not detokenize outputs.")
    parser.add_argument("--use-tqdm", action="store_true", help="Show a progress bar.")
    parser.add_argument("--output-json", type=str, default=None,
                        help="Write the results to this JSON file.")
    EngineArgs.add_cli_args(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    from kvserve.benchmarks.weights import gguf_quantization, weights_label
    from kvserve.config import is_gguf, load_hf_config, resolve_dtype
    from kvserve.model.demo import resolve_model_path
    from kvserve.model.gguf import read_gguf_config
    from kvserve.tokenizer import Tokenizer

    if args.n < 1:
        raise ValueError(f"n must be >= 1, got {args.n}.")
    engine_args = EngineArgs.from_cli_args(args)
    model_path = resolve_model_path(engine_args.model, engine_args.load_format)
    tokenizer = Tokenizer.from_pretrained(
        resolve_model_path(engine_args.tokenizer) if engine_args.tokenizer else model_path)
    fmt, hf_dir = engine_args.load_format, engine_args.hf_config_path
    hf_config, _ = load_hf_config(model_path, hf_dir, is_gguf(model_path, fmt),
                                  read_gguf_config(model_path, fmt, hf_dir))
    max_model_len = engine_args.max_model_len or int(hf_config["max_position_embeddings"])
    requests = get_samples(args, model_path, tokenizer, max_model_len)
    extra: dict[str, Any] = {"dataset_name": args.dataset_name, "model": engine_args.model}

    if args.backend == "kvserve":
        from kvserve.entrypoints.llm import LLM

        llm = LLM(**vars(engine_args))
        try:
            extra["dtype"] = str(llm.llm_engine.config.model_config.dtype).replace("torch.", "")
            extra["weights"] = weights_label(llm.llm_engine.config.model_config)
            warmup_kvserve(llm, requests[0].prompt_token_ids[-1])
            before = llm.get_stats()
            elapsed, output_lens = run_kvserve(requests, llm, args.n, args.temperature,
                                               not args.disable_detokenize, args.use_tqdm,
                                               warmup=False)
            after = llm.get_stats()
        finally:
            llm.shutdown()
        extra["enable_prefix_caching"] = engine_args.enable_prefix_caching
        extra["prefix_cache_queries"] = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        extra["prefix_cache_hits"] = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        # Token-weighted: cached prompt tokens / prompt tokens looked up.
        extra["prefix_cache_hit_rate"] = (extra["prefix_cache_hits"] / extra["prefix_cache_queries"]
                                          if extra["prefix_cache_queries"] else 0.0)
        extra["num_preemptions"] = after["num_preemptions"] - before["num_preemptions"]
    else:
        device = resolve_device(engine_args.device)
        dtype = resolve_dtype(engine_args.dtype, hf_config, device)
        model = load_hf_model(model_path, dtype, device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        elapsed, output_lens = run_hf(requests, model, args.hf_max_batch_size, pad, args.n,
                                      args.temperature)
        extra.update(dtype=str(dtype).replace("torch.", ""),
                     hf_max_batch_size=args.hf_max_batch_size,
                     weights=(f"{gguf_quantization(model_path)}, dequantized by transformers, "
                              if os.path.isfile(model_path) else "")
                     + str(dtype).replace("torch.", ""))
    result = make_result(args.backend, elapsed, requests, output_lens, args.n, extra)
    print(format_throughput(result))
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def format_throughput(result: dict[str, Any]) -> str:
    line = (f"Throughput ({result['backend']}): {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s, "
            f"{result['output_tokens_per_second']:.2f} output tokens/s "
            f"({result['num_requests']} requests, {result['total_prompt_tokens']} prompt + "
            f"{result['total_output_tokens']} output tokens in {result['elapsed_time']:.2f} s)")
    if result.get("weights"):
        line += f"\nWeights: {result['weights']}"
    if result.get("prefix_cache_queries"):
        line += f"\nPrefix cache hit rate: {100 * result['prefix_cache_hit_rate']:.1f}% of prompt tokens"
    return line


if __name__ == "__main__":
    import sys

    from kvserve.benchmarks.cli import main as _bench_main
    sys.exit(_bench_main(["throughput", *sys.argv[1:]]))
