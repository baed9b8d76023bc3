"""Paged prefill attention: the C++ CPU kernel vs the per-chunk SDPA loop, in one run.

For each case (a step's prefill chunks: query lengths and cached-context lengths) it builds a
paged KV cache whose blocks are scattered at random, times the kernel (one call for all chunks)
and the loop that Attention._prefill runs today (per chunk: F.scaled_dot_product_attention on
the chunk's own K/V when it has no context, else K/V gathered from the cache plus a bool mask),
calls interleaved, best of --iters, and prints milliseconds, GFLOP/s and the speedup.
FLOPs count only what causal attention needs: 4 * D per (query, visible key, head).

    python benchmarks/prefill_attention.py [--dtypes bfloat16 float32] [--iters 10]
        [--threads 2] [--block-size 16] [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kvserve.ops import prefill_attention as pf


@dataclass
class Case:
    name: str
    query_lens: list[int]
    context_lens: list[int]
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int = 64


def cases() -> list[Case]:
    gen = torch.Generator().manual_seed(0)
    mix = torch.randint(32, 513, (8,), generator=gen).tolist()      # offline-benchmark prompts
    return [
        Case("L=272", [272], [0]),
        Case("L=512", [512], [0]),
        Case("L=512 D=128", [512], [0], head_dim=128),
        Case("L=512 GQA 8/2", [512], [0], num_heads=8, num_kv_heads=2),
        Case("ctx 256 + 256", [256], [256]),
        Case("8 chunks 32..512", mix, [0] * len(mix)),
        Case("4 chunks ctx+new", [128, 256, 64, 200], [384, 128, 500, 0]),
    ]


def best_time(fns: dict[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Best wall time of each function, calls interleaved round-robin."""
    for fn in fns.values():
        fn()                                     # warm-up: page faults, first-call setup
    best = {name: float("inf") for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def make_inputs(case: Case, block_size: int, dtype: torch.dtype, seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """A step whose chunks' own K/V sit in k/v (rows after 4 decode rows) and in the cache."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv, d, bs = case.num_heads, case.num_kv_heads, case.head_dim, block_size
    totals = [c + n for c, n in zip(case.context_lens, case.query_lens)]
    needed = [-(-t // bs) for t in totals]
    num_blocks = 2 * sum(needed)                        # half of the cache in use
    kv_cache = torch.randn(2, num_blocks, bs, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(totals), max(needed), dtype=torch.int64)
    decodes = 4
    starts, used = [], 0
    for p, nb in enumerate(needed):
        tables[p, :nb] = perm[used:used + nb]
        used += nb
        starts.append(decodes + sum(case.query_lens[:p]))
    t = decodes + sum(case.query_lens)
    q = torch.randn(t, h, d, generator=gen).to(dtype)
    # The chunk's new K/V as the layer has them (what Attention._prefill reads when ctx == 0).
    k = torch.empty(t, hkv, d, dtype=dtype)
    v = torch.empty(t, hkv, d, dtype=dtype)
    for p, (s, n, c) in enumerate(zip(starts, case.query_lens, case.context_lens)):
        pos = torch.arange(c, c + n)
        blocks, offs = tables[p, pos // bs], pos % bs
        k[s:s + n] = kv_cache[0, blocks, offs]
        v[s:s + n] = kv_cache[1, blocks, offs]
    return dict(q=q, k=k, v=v, kv_cache=kv_cache, tables=tables,
                starts=torch.tensor(starts), lens=torch.tensor(case.query_lens),
                ctx=torch.tensor(case.context_lens))


def sdpa_loop(x: dict[str, torch.Tensor], block_size: int, scale: float,
              meta: list[tuple[int, int, int]]) -> torch.Tensor:
    """What Attention.forward + _prefill do today for the prefill chunks of a step."""
    q, k, v, kv_cache = x["q"], x["k"], x["v"], x["kv_cache"]
    gqa = q.shape[1] != kv_cache.shape[3]
    out = torch.empty_like(q)
    for p, (start, qlen, ctx) in enumerate(meta):
        cq = q[start:start + qlen]
        if ctx == 0:
            keys, values, mask, causal = k[start:start + qlen], v[start:start + qlen], None, True
        else:
            total = ctx + qlen
            blocks = x["tables"][p, :-(-total // block_size)]
            keys = kv_cache[0][blocks].flatten(0, 1)[:total]
            values = kv_cache[1][blocks].flatten(0, 1)[:total]
            pos_q = torch.arange(ctx, total)
            mask, causal = torch.arange(total)[None, :] <= pos_q[:, None], False
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        o = F.scaled_dot_product_attention(cq.transpose(0, 1)[None], keys[None], values[None],
                                           attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=gqa)[0]
        out[start:start + qlen] = o.transpose(0, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=["bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    kernel = pf.cpu_kernel()
    if kernel is None:
        raise SystemExit("the C++ kernel is not available (see the log); nothing to compare")
    print(f"kernel ready in {time.perf_counter() - t0:.1f} s (build or cache), "
          f"isa={pf.cpu_kernel_isa()}, threads={torch.get_num_threads()}, "
          f"block size {args.block_size}")
    header = (f"{'dtype':>8} {'case':>18} {'H/Hkv':>5} {'D':>4} | {'kernel ms':>9} {'GF/s':>6} | "
              f"{'sdpa ms':>9} {'GF/s':>6} | {'speedup':>7} {'max diff':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for case in cases():
                x = make_inputs(case, args.block_size, dtype)
                scale = case.head_dim ** -0.5
                meta = list(zip(x["starts"].tolist(), case.query_lens, case.context_lens))

                def run_kernel() -> torch.Tensor:
                    return kernel(x["q"], x["kv_cache"], x["starts"], x["lens"], x["ctx"],
                                  x["tables"], scale)

                def run_sdpa() -> torch.Tensor:
                    return sdpa_loop(x, args.block_size, scale, meta)

                rows_sel = torch.cat([torch.arange(s, s + n) for s, n, _ in meta])
                max_diff = (run_kernel()[rows_sel].float()
                            - run_sdpa()[rows_sel].float()).abs().max().item()
                times = best_time({"kernel": run_kernel, "sdpa": run_sdpa}, args.iters)
                flops = sum(4 * case.head_dim * case.num_heads * (n * c + n * (n + 1) // 2)
                            for _, n, c in meta)
                row = dict(dtype=dtype_name, case=case.name, num_heads=case.num_heads,
                           num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                           query_lens=case.query_lens, context_lens=case.context_lens,
                           kernel_ms=times["kernel"] * 1e3, sdpa_ms=times["sdpa"] * 1e3,
                           kernel_gflops=flops / times["kernel"] / 1e9,
                           sdpa_gflops=flops / times["sdpa"] / 1e9,
                           speedup=times["sdpa"] / times["kernel"], max_diff=max_diff)
                rows.append(row)
                print(f"{dtype_name:>8} {case.name:>18} {case.num_heads:>2}/{case.num_kv_heads:<2} "
                      f"{case.head_dim:>4} | {row['kernel_ms']:>9.3f} {row['kernel_gflops']:>6.0f}"
                      f" | {row['sdpa_ms']:>9.3f} {row['sdpa_gflops']:>6.0f} | "
                      f"{row['speedup']:>6.2f}x {max_diff:>8.1e}", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(threads=torch.get_num_threads(), isa=pf.cpu_kernel_isa(),
                           args=vars(args), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
