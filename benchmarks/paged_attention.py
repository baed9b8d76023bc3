"""Paged decode attention: the C++ CPU kernel vs the pure-torch path, in one run.

For each (dtype, num_seqs, seq_len) it builds a paged KV cache with every sequence's blocks
scattered at random (as after some time serving), times both implementations alternately
(best of --iters, so machine noise hits both alike), and prints milliseconds, the effective
bandwidth of the K/V bytes each call must read, and the speedup.

    python benchmarks/paged_attention.py [--num-seqs 1 16 64] [--seq-lens 128 512 1024]
        [--dtypes bfloat16 float32] [--num-heads 12] [--num-kv-heads 12] [--head-dim 64]
        [--block-size 16] [--iters 10] [--threads 2] [--layers 1] [--output-json out.json]

Defaults are the ~110M benchmark Llama's attention (12 heads x 64, no GQA). --layers N builds N
caches (each its own scattered blocks) and each call takes the next, as a decode step's layers
do: with N x the KV bytes over the L3 size, every call reads its K/V from memory (with 1, a
small cache is read from L3 after the first call). Compare with the
machine's memory read bandwidth (28-35 GB/s here, ../shared/PERF_NOTES.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any, Callable

import torch

from kvserve.ops import paged_attention as pa


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


def make_inputs(num_seqs: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq * 2               # half of the cache in use
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                           generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * blocks_per_seq]
    tables = tables.view(num_seqs, blocks_per_seq)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return q, kv_cache, tables, torch.full((num_seqs,), seq_len, dtype=torch.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=["bfloat16", "float32"])
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--layers", type=int, default=1,
                        help="caches cycled through, one a call (see above)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    kernel = pa.cpu_kernel()
    if kernel is None:
        raise SystemExit("the C++ kernel is not available (see the log); nothing to compare")
    print(f"kernel ready in {time.perf_counter() - t0:.1f} s (build or cache), "
          f"isa={pa.cpu_kernel_isa()}, threads={torch.get_num_threads()}, "
          f"heads {args.num_heads}/{args.num_kv_heads} x {args.head_dim}, "
          f"block size {args.block_size}")
    header = (f"{'dtype':>8} {'seqs':>5} {'len':>5} {'KV MB':>7} | {'kernel ms':>9} {'GB/s':>6} | "
              f"{'torch ms':>9} {'GB/s':>6} | {'speedup':>7}")
    print(header)
    print("-" * len(header))
    rows = []
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for num_seqs in args.num_seqs:
                for seq_len in args.seq_lens:
                    layers = [make_inputs(num_seqs, seq_len, args.num_heads,
                                          args.num_kv_heads, args.head_dim, args.block_size,
                                          dtype, seed=i) for i in range(args.layers)]
                    q, kv_cache, tables, lens = layers[0]
                    scale = args.head_dim ** -0.5
                    out_k = kernel(q, kv_cache, tables, lens, scale)
                    out_t = pa.paged_decode_attention_torch(q, kv_cache, tables, lens, scale)
                    max_diff = (out_k.float() - out_t.float()).abs().max().item()
                    kernel_in, torch_in = itertools.cycle(layers), itertools.cycle(layers)
                    times = best_time({
                        "kernel": lambda: kernel(*next(kernel_in), scale),
                        "torch": lambda: pa.paged_decode_attention_torch(*next(torch_in), scale),
                    }, args.iters * args.layers)
                    kv_bytes = (2 * num_seqs * seq_len * args.num_kv_heads * args.head_dim
                                * kv_cache.element_size())
                    row = dict(dtype=dtype_name, num_seqs=num_seqs, seq_len=seq_len,
                               kv_mb=kv_bytes / 1e6, kernel_ms=times["kernel"] * 1e3,
                               torch_ms=times["torch"] * 1e3,
                               kernel_gbps=kv_bytes / times["kernel"] / 1e9,
                               torch_gbps=kv_bytes / times["torch"] / 1e9,
                               speedup=times["torch"] / times["kernel"], max_diff=max_diff)
                    rows.append(row)
                    print(f"{dtype_name:>8} {num_seqs:>5} {seq_len:>5} {row['kv_mb']:>7.1f} | "
                          f"{row['kernel_ms']:>9.3f} {row['kernel_gbps']:>6.1f} | "
                          f"{row['torch_ms']:>9.3f} {row['torch_gbps']:>6.1f} | "
                          f"{row['speedup']:>6.1f}x", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(threads=torch.get_num_threads(), isa=pa.cpu_kernel_isa(),
                           args=vars(args), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
