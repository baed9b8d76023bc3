"""Fused CPU ops (kvserve.ops.fused): the C++ kernels vs the torch code they replace, in one run.

1. Per op and row count T (default 1, 8, 64, 2048), on the benchmark Llama's shapes (hidden
   768, 12 q / 12 kv heads of 64, intermediate 2048, 16-token blocks): the kernel wrapper and
   the torch path are timed alternately, best of --iters (each timing a loop long enough to be
   well above the clock's resolution), so machine noise hits both alike. Printed: microseconds
   per call for each and the speedup.
2. With --model: batch-1 decode of an LLM (multiprocessing off, so the switch reaches the model)
   with the fused kernels on and off (kvserve.ops.fused.set_kernels_enabled; the GEMV and
   paged-attention kernels stay on in both), interleaved, best of --e2e-iters: --decode-tokens
   greedy tokens (EOS ignored) from a fresh --prompt-len-token random prompt each time.

    python benchmarks/fused_ops.py [--rows 1 8 64 2048] [--dtypes bfloat16 float32]
        [--iters 15] [--threads 2] [--model /tmp/m110 --e2e-dtype bfloat16] [--output-json f]
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import torch

from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.ops import fused as kf

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 768, 12, 12, 64, 2048
BLOCK_SIZE, MAX_POS = 16, 2048


def best_us(fn: Callable[[], Any], iters: int, min_loop_s: float = 2e-3) -> float:
    """Best per-call time over `iters` timings, each a loop of calls lasting >= min_loop_s."""
    fn()
    n, t = 1, 0.0
    while True:    # calibrate the loop length once
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        if t >= min_loop_s:
            break
        n *= 2
    best = t / n
    for _ in range(iters - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def op_cases(t: int, dtype: torch.dtype) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """name -> (kernel call, torch call) on fresh inputs of t rows."""
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, HIDDEN, generator=gen).to(dtype)
    res = torch.randn(t, HIDDEN, generator=gen).to(dtype)
    w = torch.ones(HIDDEN, dtype=dtype)
    # The in-place kernels write their own buffers (timing them on x/res would also be fine:
    # the norm keeps values bounded), the torch path reads x/res.
    xk, rk = x.clone(), res.clone()
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, 10000.0)
    positions = torch.randint(0, MAX_POS, (t,), generator=gen)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.randn(t, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rope_args = (HEAD_DIM, rope.cos_cache, rope.sin_cache)
    gate_up = torch.randn(t, 2 * INTER, generator=gen).to(dtype)
    num_blocks = -(-t // BLOCK_SIZE) * 2
    cache = torch.zeros(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:t]
    k3, v3 = k.view(t, KV_HEADS, HEAD_DIM), v.view(t, KV_HEADS, HEAD_DIM)
    return {
        "rms_norm": (lambda: kf.rms_norm(x, w, 1e-5), lambda: kf.rms_norm_torch(x, w, 1e-5)),
        "fused_add_rms_norm": (lambda: kf.fused_add_rms_norm(xk, rk, w, 1e-5),
                               lambda: kf.fused_add_rms_norm_torch(x, res, w, 1e-5)),
        "rotary_embedding": (lambda: kf.rotary_embedding(positions, q, k, *rope_args),
                             lambda: kf.rotary_embedding_torch(positions, q, k, *rope_args)),
        "silu_and_mul": (lambda: kf.silu_and_mul(gate_up), lambda: kf.silu_and_mul_torch(gate_up)),
        "reshape_and_cache": (lambda: kf.reshape_and_cache(k3, v3, cache, slots),
                              lambda: kf.reshape_and_cache_torch(k3, v3, cache, slots)),
    }


def bench_ops(rows: list[int], dtypes: list[str], iters: int) -> list[dict[str, Any]]:
    results = []
    print(f"{'op':<20} {'dtype':<9} {'T':>5} {'kernel us':>10} {'torch us':>10} {'speedup':>8}")
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for t in rows:
            for name, (kernel, ref) in op_cases(t, dtype).items():
                k_us, t_us = float("inf"), float("inf")
                for _ in range(3):     # alternate, so a noisy stretch hits both
                    k_us = min(k_us, best_us(kernel, iters))
                    t_us = min(t_us, best_us(ref, iters))
                results.append({"op": name, "dtype": dtype_name, "rows": t, "kernel_us": k_us,
                                "torch_us": t_us, "speedup": t_us / k_us})
                print(f"{name:<20} {dtype_name:<9} {t:>5} {k_us:>10.2f} {t_us:>10.2f} "
                      f"{t_us / k_us:>7.2f}x", flush=True)
    return results


def bench_decode(model: str, dtype: str, prompt_len: int, decode_tokens: int,
                 iters: int) -> dict[str, Any]:
    from kvserve import LLM
    from kvserve.benchmarks.latency import random_token_prompts
    from kvserve.sampling_params import SamplingParams

    # Prefix caching off: the greedy comparison below runs one prompt on both paths.
    llm = LLM(model, dtype=dtype, max_model_len=1024, multiprocessing=False,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=decode_tokens,
                            detokenize=False)
    times: dict[str, list[float]] = {"on": [], "off": []}
    outputs: dict[str, list[int]] = {}
    seed = 0
    try:
        for mode in ("on", "off"):     # warm-up (first calls build / load the kernels)
            kf.set_kernels_enabled(mode == "on")
            llm.generate(random_token_prompts(llm, 1, prompt_len, seed), params, use_tqdm=False)
            seed += 1
        same_prompt = random_token_prompts(llm, 1, prompt_len, 12345)
        for i in range(iters):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                kf.set_kernels_enabled(mode == "on")
                prompts = random_token_prompts(llm, 1, prompt_len, seed)
                seed += 1
                t0 = time.perf_counter()
                out = llm.generate(prompts, params, use_tqdm=False)
                times[mode].append(time.perf_counter() - t0)
                assert len(out[0].outputs[0].token_ids) == decode_tokens
        for mode in ("on", "off"):     # greedy tokens on one prompt, both paths
            kf.set_kernels_enabled(mode == "on")
            outputs[mode] = list(llm.generate(same_prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        kf.set_kernels_enabled(True)
        llm.shutdown()
    best = {m: min(ts) for m, ts in times.items()}
    agree = sum(a == b for a, b in zip(outputs["on"], outputs["off"]))
    result = {"model": model, "dtype": dtype, "prompt_len": prompt_len,
              "decode_tokens": decode_tokens, "iters": iters,
              "tok_s_on": decode_tokens / best["on"], "tok_s_off": decode_tokens / best["off"],
              "ms_per_token_on": 1e3 * best["on"] / decode_tokens,
              "ms_per_token_off": 1e3 * best["off"] / decode_tokens,
              "speedup": best["off"] / best["on"], "all_times_s": times,
              "greedy_tokens_agree": f"{agree}/{decode_tokens}"}
    print(f"\nbatch-1 decode, {model} {dtype}, {decode_tokens} tokens from a {prompt_len}-token "
          f"prompt (prefill included), best of {iters}:\n"
          f"  fused kernels on : {result['tok_s_on']:.1f} tok/s ({result['ms_per_token_on']:.2f} ms/token)\n"
          f"  fused kernels off: {result['tok_s_off']:.1f} tok/s ({result['ms_per_token_off']:.2f} ms/token)\n"
          f"  speedup {result['speedup']:.3f}x; greedy tokens agree {agree}/{decode_tokens}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 2048])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-ops", action="store_true", help="only the end-to-end decode")
    p.add_argument("--model", help="e.g. /tmp/m110: also time batch-1 decode with kernels on/off")
    p.add_argument("--e2e-dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--e2e-iters", type=int, default=3)
    p.add_argument("--output-json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not kf.kernels_active():
        raise SystemExit("the fused C++ kernels are not available (build failed or disabled)")
    print(f"fused kernels: {kf.cpu_kernel_isa()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    result: dict[str, Any] = {"isa": kf.cpu_kernel_isa(), "threads": torch.get_num_threads()}
    if not args.skip_ops:
        with torch.inference_mode():
            result["ops"] = bench_ops(args.rows, args.dtypes, args.iters)
    if args.model:
        result["decode"] = bench_decode(args.model, args.e2e_dtype, args.prompt_len,
                                        args.decode_tokens, args.e2e_iters)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
