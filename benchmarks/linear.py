"""Small-batch linear: the C++ CPU kernel (kvserve.ops.linear) vs F.linear, in one run.

For each (dtype, shape, M) both are timed alternately (best of --iters, so machine noise hits
both alike); printed: microseconds, the effective bandwidth of the weight bytes each call must
read (GB/s), and the speedup. Compare with the machine's memory read bandwidth (28-35 GB/s
here, ../shared/PERF_NOTES.md). The weights are bigger than L2, and the shapes are cycled so a
weight is not still in L3 from its previous call (the model's 219 MB never is).

    python benchmarks/linear.py [--rows 1 2 4 8 16] [--dtypes bfloat16 float32]
        [--shapes 768x2304 768x768 768x4096 2048x768 768x32000] [--iters 20] [--threads 2]
        [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
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
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="KxN (in x out)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output-json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    op = kl.cpu_kernel()
    if op is None:
        raise SystemExit("the C++ kernel is unavailable (see the log); nothing to compare")
    print(f"kernel: {kl.cpu_kernel_isa()}, threads: {torch.get_num_threads()}")
    print(f"{'dtype':>9} {'K x N':>10} {'M':>3} {'kernel us':>10} {'torch us':>10} "
          f"{'kernel GB/s':>11} {'torch GB/s':>10} {'speedup':>7}")
    results: list[dict[str, Any]] = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for shape in args.shapes:
            k, n = (int(v) for v in shape.split("x"))
            nbytes = n * k * dtype.itemsize
            copies = max(2, _COPIES_BYTES // nbytes)
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            for m in args.rows:
                x = torch.randn(m, k).to(dtype)
                best = {"kernel": float("inf"), "torch": float("inf")}
                fns = {"kernel": lambda w: op(x, w, None), "torch": lambda w: F.linear(x, w)}
                for fn in fns.values():
                    fn(weights[0])                         # warm-up
                for i in range(args.iters):
                    for name, fn in fns.items():
                        w = weights[(i * 2 + (name == "torch")) % copies]
                        t0 = time.perf_counter()
                        fn(w)
                        best[name] = min(best[name], time.perf_counter() - t0)
                gbs = {name: nbytes / t / 1e9 for name, t in best.items()}
                print(f"{dname:>9} {shape:>10} {m:>3} {best['kernel'] * 1e6:>10.1f} "
                      f"{best['torch'] * 1e6:>10.1f} {gbs['kernel']:>11.1f} {gbs['torch']:>10.1f} "
                      f"{best['torch'] / best['kernel']:>6.2f}x", flush=True)
                results.append(dict(dtype=dname, k=k, n=n, m=m, kernel_s=best["kernel"],
                                    torch_s=best["torch"], kernel_gbs=gbs["kernel"],
                                    torch_gbs=gbs["torch"]))
            del weights
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
