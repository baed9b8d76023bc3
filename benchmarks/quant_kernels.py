"""GGUF weights kept packed (kvserve/ops/quant) against today's float32 path, on SmolLM2-135M's
linear shapes (hidden 576, intermediate 1536, GQA 9/3 heads of 64: qkv 960 x 576, o 576 x 576,
gate_up 3072 x 576, down 576 x 1536, the tied LM head 49152 x 576).

Small batches (--rows, decode): the int8 kernel on the packed blocks against ops.linear on the
same weight dequantized to float32 and tiled (the small-batch kernel kvserve runs today), per
call: microseconds, the bytes each call streams and the effective GB/s; then one token's worth
(30 layers + the LM head) at M = 1.
Large batches (--large-rows, prefill): the int8 kernel, the packed weight dequantized in chunks
into torch's float32 GEMM (PackedQuantWeight's large-batch path), and the float32 weight
prepacked for oneDNN (today's path for a float32 model).

Dequantization (--dequant): ns a weight of the tier's dequantizer (AVX2: a group-block of 8
rows at a time) against the portable row decoder, on 256-row chunks as the float path takes
them; the large-batch table then has a column with the portable dequantizer too.

Weights are random valid blocks (speed does not depend on values). Each side cycles through
enough copies (> 96 MB) that a weight is never still in cache from its previous call, as in a
decode step over the whole model. The timings alternate between the paths (time_alternately of
benchmarks/linear.py).

    python benchmarks/quant_kernels.py [--types Q4_1 Q8_0 Q5_0 Q4_K Q6_K] [--rows 1 2 4 8]
        [--large-rows 16 64 256] [--dequant] [--threads 1] [--iters 30] [--stat median] [--clock cpu]
        [--output-json out.json]

The int8 GEMM (--gemm-rows: the K-quants' prompts and large decode batches, every tier from
avx2): x in --gemm-dtype (bfloat16, the avx512_bf16 tier's default; float32, the avx2 tier's)
on the 0.85B Llama's shapes, against the path it replaces (dequantized chunks into GEMMs in
x's dtype) and the small-batch kernel (`ops.linear`, which itself hands the GEMM
gemm_min_rows() rows and more).

    python benchmarks/quant_kernels.py --types Q4_K --rows --large-rows --gemm-rows 4 8 16 64 512
        --threads 2 [--gemm-dtype float32]

K-quants apply only where K is a multiple of 256 (down, 1536 wide); llama.cpp's Q4_K_M stores
the 576-wide rows as Q5_0. On a shared machine: --threads 1 --clock cpu --stat median.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.linear import time_alternately  # noqa: E402
from kvserve.ops import cpu_isa, linear as kl  # noqa: E402
from kvserve.ops.quant import FORMATS, PackedQuantWeight, kernel  # noqa: E402
from kvserve.ops.quant import weight as qweight  # noqa: E402

# (name, N, K, calls per token)
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head", 49152, 576, 1)]
_COPIES_BYTES = 96 << 20


def random_weight(name: str, n: int, k: int, rng: np.random.Generator) -> PackedQuantWeight:
    fmt = FORMATS[name]
    raw = rng.integers(0, 256, size=(n, k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    scales = np.frombuffer(rng.uniform(-0.02, 0.02, raw.shape[:2]).astype(np.float16).tobytes(),
                           np.uint8).reshape(*raw.shape[:2], 2)
    if name == "Q6_K":
        raw[..., 208:210] = scales
    else:
        raw[..., 0:2] = raw[..., 2:4] = scales
    return PackedQuantWeight.from_gguf(name, raw.reshape(n, -1), (n, k))


def small_batches(args: argparse.Namespace, ops: Any) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    f32_op = kl.cpu_kernel()
    print(f"{'type':>5} {'shape':>8} {'N x K':>11} {'M':>3} {'int8 us':>8} {'f32 us':>8} "
          f"{'speedup':>7} {'packed MB':>9} {'f32 MB':>7} {'int8 GB/s':>9} {'f32 GB/s':>8}")
    for qtype in args.types:
        fmt = FORMATS[qtype]
        for label, n, k, _ in SHAPES:
            if k % fmt.block_size:
                continue
            first = random_weight(qtype, n, k, rng)
            copies = max(2, min(512, _COPIES_BYTES // first.nbytes))
            packed = [first] + [random_weight(qtype, n, k, rng) for _ in range(copies - 1)]
            f_copies = max(2, min(copies, _COPIES_BYTES // (4 * n * k)))
            floats = [kl.tile_weight(p.dequantize()) for p in packed[:f_copies]]
            floats = [f if f is not None else packed[i].dequantize() for i, f in enumerate(floats)]
            for m in args.rows:
                x = torch.randn(m, k)
                fns = {"int8": lambda i: ops.linear(x, packed[i % copies].packed, fmt.ggml_type, n),
                       "f32": lambda i: f32_op(x, floats[i % f_copies], None)}
                t = time_alternately(fns, copies * f_copies, args.iters, args.stat, args.clock)
                qb, fb = first.nbytes, 4 * n * k
                print(f"{qtype:>5} {label:>8} {n:>5}x{k:<5} {m:>3} {t['int8'] * 1e6:>8.1f} "
                      f"{t['f32'] * 1e6:>8.1f} {t['f32'] / t['int8']:>6.2f}x {qb / 2**20:>9.2f} "
                      f"{fb / 2**20:>7.2f} {qb / t['int8'] / 1e9:>9.1f} "
                      f"{fb / t['f32'] / 1e9:>8.1f}",
                      flush=True)
                rows.append(dict(section="small", type=qtype, shape=label, n=n, k=k, m=m,
                                 int8_s=t["int8"], f32_s=t["f32"], packed_bytes=qb, f32_bytes=fb))
            del packed, floats
    return rows


def per_token(rows: list[dict[str, Any]]) -> None:
    """One token at M = 1: 30 layers' linears + the LM head, per type (shapes it covers)."""
    calls = {label: c for label, _, _, c in SHAPES}
    for qtype in sorted({r["type"] for r in rows}):
        sel = [r for r in rows if r["type"] == qtype and r["m"] == 1]
        if not sel:
            continue
        i8 = sum(calls[r["shape"]] * r["int8_s"] for r in sel)
        f32 = sum(calls[r["shape"]] * r["f32_s"] for r in sel)
        qb = sum(calls[r["shape"]] * r["packed_bytes"] for r in sel)
        fb = sum(calls[r["shape"]] * r["f32_bytes"] for r in sel)
        shapes = ", ".join(r["shape"] for r in sel)
        print(f"{qtype}: one token's linears ({shapes}) at M=1: int8 {i8 * 1e3:.2f} ms "
              f"({qb / 2**20:.1f} MB, {qb / i8 / 1e9:.1f} GB/s), float32 {f32 * 1e3:.2f} ms "
              f"({fb / 2**20:.1f} MB, {fb / f32 / 1e9:.1f} GB/s): {f32 / i8:.2f}x")


def dequant_speed(args: argparse.Namespace, ops: Any) -> list[dict[str, Any]]:
    """ns a weight: the tier's dequantizer and the portable one, alternating, 256-row chunks."""
    rng = np.random.default_rng(2)
    rows: list[dict[str, Any]] = []
    print(f"\n{'type':>5} {'shape':>8} {'tier ns/w':>9} {'portable ns/w':>13} {'speedup':>7}")
    for qtype in args.types:
        fmt = FORMATS[qtype]
        for label, n, k, _ in SHAPES[:4]:
            if k % fmt.block_size:
                continue
            w = random_weight(qtype, n, k, rng)

            def run(fn: Any) -> Any:
                return lambda i: [fn(w.packed, fmt.ggml_type, n, r, min(n, r + 256))
                                  for r in range(0, n, 256)]
            t = time_alternately({"tier": run(ops.dequantize), "portable": run(
                ops.dequantize_generic)}, 1, args.iters, args.stat, args.clock)
            print(f"{qtype:>5} {label:>8} {t['tier'] / (n * k) * 1e9:>9.3f} "
                  f"{t['portable'] / (n * k) * 1e9:>13.3f} {t['portable'] / t['tier']:>6.1f}x",
                  flush=True)
            rows.append(dict(section="dequant", type=qtype, shape=label, n=n, k=k,
                             tier_s=t["tier"], portable_s=t["portable"]))
    return rows


def _portable_dequantized_matmul(ops: Any, w: PackedQuantWeight, x: torch.Tensor) -> torch.Tensor:
    """PackedQuantWeight.dequantized_matmul with the portable dequantizer (same chunks)."""
    n, k = w.shape
    step = max(8, qweight.CHUNK_ELEMS // k // 8 * 8)
    y = torch.empty(x.shape[0], n)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        y[:, r0:r1] = kl.mm_t(x, ops.dequantize_generic(w.packed, w.fmt.ggml_type, n, r0, r1))
    return y


def large_batches(args: argparse.Namespace, ops: Any) -> list[dict[str, Any]]:
    rng = np.random.default_rng(1)
    rows: list[dict[str, Any]] = []
    print(f"\n{'type':>5} {'shape':>8} {'M':>4} {'int8 us':>9} {'deq+gemm us':>11} "
          f"{'f32 packed us':>13} {'deq/int8':>8}" + (f" {'portable deq+gemm us':>20}"
                                                      if args.dequant else ""))
    for qtype in args.types:
        fmt = FORMATS[qtype]
        for label, n, k, _ in SHAPES:
            if k % fmt.block_size or label == "lm_head" and not args.lm_head_large:
                continue
            ws = [random_weight(qtype, n, k, rng) for _ in range(2)]
            prepacked = [kl.pack_weight(w.dequantize()) for w in ws]
            for m in args.large_rows:
                x = torch.randn(m, k)
                fns = {"int8": lambda i: ops.linear(x, ws[i % 2].packed, fmt.ggml_type, n),
                       "deq": lambda i: ws[i % 2].dequantized_matmul(x)}
                if prepacked[0] is not None:
                    fns["f32"] = lambda i: kl.packed_linear(x, prepacked[i % 2])
                if args.dequant:
                    fns["portable"] = lambda i: _portable_dequantized_matmul(ops, ws[i % 2], x)
                t = time_alternately(fns, 2, max(5, args.iters // 3), args.stat, args.clock)
                f32 = t.get("f32", float("nan"))
                print(f"{qtype:>5} {label:>8} {m:>4} {t['int8'] * 1e6:>9.0f} "
                      f"{t['deq'] * 1e6:>11.0f} {f32 * 1e6:>13.0f} "
                      f"{t['deq'] / t['int8']:>7.2f}x" + (f" {t['portable'] * 1e6:>20.0f}"
                                                          if args.dequant else ""), flush=True)
                rows.append(dict(section="large", type=qtype, shape=label, n=n, k=k, m=m,
                                 int8_s=t["int8"], dequant_gemm_s=t["deq"], f32_packed_s=f32,
                                 portable_dequant_gemm_s=t.get("portable")))
    return rows


# The 0.85B Llama's (benchmarks/make_quantized_llama.py) Q4_K shapes: qkv, o, gate_up, down.
GEMM_SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048),
               ("down", 2048, 5632)]


def gemm_batches(args: argparse.Namespace, ops: Any) -> list[dict[str, Any]]:
    """The int8 GEMM (csrc/quant_gemm.h) against the path it replaces for prompts (dequantized
    chunks into GEMMs in x's dtype, --gemm-dtype) and the small-batch kernel, per call."""
    rng = np.random.default_rng(3)
    rows: list[dict[str, Any]] = []
    dtype = getattr(torch, args.gemm_dtype)
    tag = "bf16" if dtype == torch.bfloat16 else "f32"
    print(f"\n{'type':>5} {'shape':>8} {'M':>4} {'gemm us':>9} {tag + ' deq us':>11} "
          f"{'int8 small us':>13} {'gemm GOP/s':>10} {tag + '/gemm':>9} {'small/gemm':>10}")
    for qtype in [t for t in args.types if ops.gemm_supports(FORMATS[t].ggml_type)]:
        fmt = FORMATS[qtype]
        for label, n, k in GEMM_SHAPES:
            ws = [random_weight(qtype, n, k, rng) for _ in range(2)]
            for m in args.gemm_rows:
                x = torch.randn(m, k).to(dtype)
                fns = {"gemm": lambda i: ops.gemm(x, ws[i % 2].packed, fmt.ggml_type, n),
                       "deq": lambda i: ws[i % 2].dequantized_matmul(x),
                       "small": lambda i: ops.linear(x, ws[i % 2].packed, fmt.ggml_type, n)}
                t = time_alternately(fns, 2, max(5, args.iters // 3), args.stat, args.clock)
                print(f"{qtype:>5} {label:>8} {m:>4} {t['gemm'] * 1e6:>9.0f} "
                      f"{t['deq'] * 1e6:>11.0f} {t['small'] * 1e6:>13.0f} "
                      f"{2 * m * n * k / t['gemm'] / 1e9:>10.0f} {t['deq'] / t['gemm']:>8.2f}x "
                      f"{t['small'] / t['gemm']:>9.2f}x", flush=True)
                rows.append(dict(section="gemm", type=qtype, shape=label, n=n, k=k, m=m,
                                 x_dtype=args.gemm_dtype, gemm_s=t["gemm"],
                                 **{f"{tag}_dequant_gemm_s": t["deq"]},
                                 int8_small_s=t["small"]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--types", nargs="+", default=["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K"])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--large-rows", type=int, nargs="*", default=[16, 64, 256])
    p.add_argument("--lm-head-large", action="store_true", help="the LM head at large M too")
    p.add_argument("--dequant", action="store_true",
                   help="the dequantizers' speed (tier vs portable), and a portable column")
    p.add_argument("--gemm-rows", type=int, nargs="*", default=[],
                   help="the int8 GEMM on the 0.85B Llama's shapes at these rows (x: --gemm-dtype)")
    p.add_argument("--gemm-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="--gemm-rows: x's dtype (float32: the avx2 tier's prompts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--stat", choices=["best", "median"], default="median")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--output-json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernel.ops()
    if ops is None or kl.cpu_kernel() is None:
        raise SystemExit("the C++ kernels are unavailable (see the log): nothing to compare")
    print(f"tier {cpu_isa.selected_tier()}: int8 kernel {kernel.isa()}; float32 kernel "
          f"{kl.cpu_kernel_isa()}; threads {torch.get_num_threads()}, {args.stat} of "
          f"{args.iters}, clock {args.clock}")
    rows = small_batches(args, ops) if args.rows else []
    per_token(rows)
    if args.dequant:
        rows += dequant_speed(args, ops)
    if args.large_rows:
        rows += large_batches(args, ops)
    if args.gemm_rows:
        rows += gemm_batches(args, ops)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
