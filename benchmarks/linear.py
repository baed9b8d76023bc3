"""Linear layers on CPU: the small-batch C++ kernel, F.linear, and F.linear's oneDNN path
with a prepacked weight (kvserve.ops.linear.pack_weight / packed_linear, what the model uses),
in one run.

For each (dtype, shape, M) both are timed alternately (best of --iters, so machine noise hits
both alike); printed: microseconds, the effective bandwidth of the weight bytes each call must
read (GB/s), and the speedup. Compare with the machine's memory read bandwidth (28-35 GB/s
here, ../shared/PERF_NOTES.md). The weights are bigger than L2, and the shapes are cycled so a
weight is not still in L3 from its previous call (the model's 219 MB never is).

    python benchmarks/linear.py [--rows 1 2 4 8 16] [--dtypes bfloat16 float32]
        [--shapes 768x2304 768x768 768x4096 2048x768 768x32000] [--iters 20] [--threads 2]
        [--widened] [--stat best|median] [--clock wall|cpu] [--output-json out.json]

--widened is dtype "auto" on a CPU without bf16 instructions: a 16-bit weight with float32 x.
The kernel streams the 16-bit weight (widening in registers); "torch" and "packed" use a
float32 copy of it (F.linear, and the prepacked copy kvserve keeps for large batches).
On a shared machine use --threads 1 --clock cpu --stat median: one thread's CPU time is not
inflated by another process holding the second core.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.ops import linear as kl

DEFAULT_SHAPES = ["768x2304", "768x768", "768x4096", "2048x768", "768x32000"]
# Weight copies per shape, cycled through: together > the 32 MB L3 for every default shape.
_COPIES_BYTES = 96 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="KxN (in x out)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--widened", action="store_true",
                   help="16-bit weights (--dtypes) with float32 x, as dtype auto without bf16 "
                        "instructions; torch and packed use a float32 copy")
    p.add_argument("--stat", choices=["best", "median"], default="best")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this thread's CPU time (only meaningful with --threads 1)")
    p.add_argument("--output-json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    op = kl.cpu_kernel()
    if op is None:
        raise SystemExit("the C++ kernel is unavailable (see the log); nothing to compare")
    print(f"kernel: {kl.cpu_kernel_isa()}, threads: {torch.get_num_threads()}")
    print(f"{'dtype':>9} {'K x N':>10} {'M':>4} {'kernel us':>10} {'torch us':>10} "
          f"{'packed us':>10} {'kernel GB/s':>11} {'torch GB/s':>10} {'packed GB/s':>11} "
          f"{'kernel/torch':>12} {'packed/torch':>12}")
    results: list[dict[str, Any]] = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        if args.widened and dtype not in kl.WIDENED_WEIGHT_DTYPES:
            raise SystemExit(f"--widened needs 16-bit --dtypes, got {dname}")
        dname = f"{dname}>f32" if args.widened else dname
        for shape in args.shapes:
            k, n = (int(v) for v in shape.split("x"))
            nbytes = n * k * dtype.itemsize
            copies = max(2, _COPIES_BYTES // nbytes)
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            x_dtype = torch.float32 if args.widened else dtype
            # torch and packed run on x's dtype: the float32 copies when widened.
            full = [w.to(x_dtype) for w in weights] if args.widened else weights
            packed = [kl.pack_weight(w) for w in full]
            for m in args.rows:
                x = torch.randn(m, k).to(x_dtype)
                fns = {"kernel": lambda i: op(x, weights[i], None),
                       "torch": lambda i: F.linear(x, full[i])}
                if packed[0] is not None:
                    fns["packed"] = lambda i: kl.packed_linear(x, packed[i])
                best = time_alternately(fns, copies, args.iters, args.stat, args.clock)
                gbs = {name: nbytes / t / 1e9 for name, t in best.items()}
                print(f"{dname:>9} {shape:>10} {m:>4} {best['kernel'] * 1e6:>10.1f} "
                      f"{best['torch'] * 1e6:>10.1f} {best['packed'] * 1e6:>10.1f} "
                      f"{gbs['kernel']:>11.1f} {gbs['torch']:>10.1f} {gbs['packed']:>11.1f} "
                      f"{best['torch'] / best['kernel']:>11.2f}x "
                      f"{best['torch'] / best['packed']:>11.2f}x", flush=True)
                results.append(dict(dtype=dname, k=k, n=n, m=m, kernel_s=best["kernel"],
                                    torch_s=best["torch"], packed_s=best["packed"],
                                    kernel_gbs=gbs["kernel"], torch_gbs=gbs["torch"],
                                    packed_gbs=gbs["packed"]))
            del weights, packed
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


def time_alternately(fns: dict[str, Any], copies: int, iters: int, stat: str,
                     clock: str) -> dict[str, float]:
    """Seconds per call of each function (best or median of `iters`), the functions taking
    turns so that machine noise hits them alike; fn(i) reads weight copy i."""
    now = time.thread_time if clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(0)                                          # warm-up
    for it in range(iters):
        for j, (name, fn) in enumerate(fns.items()):
            i = (it * len(fns) + j) % copies           # never the weight just read
            t0 = now()
            fn(i)
            times[name].append(now() - t0)
    pick = min if stat == "best" else statistics.median
    result = {name: pick(ts) for name, ts in times.items()}
    result.setdefault("packed", float("nan"))
    return result


if __name__ == "__main__":
    main()
