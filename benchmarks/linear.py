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
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
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
    print(f"{'dtype':>9} {'K x N':>10} {'M':>4} {'kernel us':>10} {'torch us':>10} "
          f"{'packed us':>10} {'kernel GB/s':>11} {'torch GB/s':>10} {'packed GB/s':>11} "
          f"{'kernel/torch':>12} {'packed/torch':>12}")
    results: list[dict[str, Any]] = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for shape in args.shapes:
            k, n = (int(v) for v in shape.split("x"))
            nbytes = n * k * dtype.itemsize
            copies = max(2, _COPIES_BYTES // nbytes)
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            packed = [kl.pack_weight(w) for w in weights]
            for m in args.rows:
                x = torch.randn(m, k).to(dtype)
                fns = {"kernel": lambda i: op(x, weights[i], None),
                       "torch": lambda i: F.linear(x, weights[i])}
                if packed[0] is not None:
                    fns["packed"] = lambda i: kl.packed_linear(x, packed[i])
                best = {name: float("inf") for name in fns}
                for fn in fns.values():
                    fn(0)                                  # warm-up
                for it in range(args.iters):
                    for j, (name, fn) in enumerate(fns.items()):
                        i = (it * len(fns) + j) % copies   # never the weight just read
                        t0 = time.perf_counter()
                        fn(i)
                        best[name] = min(best[name], time.perf_counter() - t0)
                best.setdefault("packed", float("nan"))
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


if __name__ == "__main__":
    main()
