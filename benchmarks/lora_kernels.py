"""The multi-LoRA delta on CPU: the C++ kernel (kvserve.ops.lora) vs the torch grouped matmuls
(kvserve.lora.punica.add_lora_torch), per decode step of a whole model.

Every LoRA linear of every layer gets its own A / B stacks (--max-loras slots, rank
--rank: q/k/v fused n=3, o, gate/up fused n=2, down), so a step streams them from memory
as the engine does. A step = the delta of all those layers for T tokens whose request i
uses adapter i mod --adapters (slots interleaved: index groups, the usual decode case);
--contiguous gives each adapter one run of tokens (a prefill-like batch). Timed alternately,
best of --iters, at each --threads count. Prints milliseconds per step and the speedup.

    python benchmarks/lora_kernels.py [--model demo|bench] [--tokens 1 8 32 64 128]
        [--adapters 4] [--rank 16] [--threads 1 2] [--iters 7] [--contiguous]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np
import torch

from kvserve.lora.punica import LoRAMapping, add_lora_torch
from kvserve.ops import lora as cpu_lora

# (hidden, intermediate, layers, q heads, kv heads, head dim)
MODELS = {"demo": (576, 1536, 30, 9, 3, 64),      # SmolLM2-135M (the demo model)
          "bench": (768, 2048, 12, 12, 12, 64)}   # benchmarks/roofline.py's Llama


def make_layers(model: str, slots: int, rank: int) -> list[tuple[torch.Tensor, ...]]:
    """(x_width, A [S, n*R, in], B [S, out, n*R]) for every LoRA linear of the model."""
    h, inter, layers, hq, hk, d = MODELS[model]
    shapes = [(h, hq * d + 2 * hk * d, 3), (hq * d, h, 1), (h, 2 * inter, 2), (inter, h, 1)]
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(layers):
        for d_in, d_out, n in shapes:
            a = torch.randn(slots, n * rank, d_in, generator=g) * 0.02
            b = torch.randn(slots, d_out, n * rank, generator=g) * 0.02
            out.append((a, b))
    return out


def best_ms(fn: Callable[[], Any], iters: int) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def run(args: argparse.Namespace) -> None:
    stacks = make_layers(args.model, args.adapters, args.rank)
    op = cpu_lora.cpu_kernel()
    assert op is not None, "the LoRA C++ kernel is unavailable"
    print(f"model {args.model}, {len(stacks)} LoRA linears, {args.adapters} adapters, rank "
          f"{args.rank}, {'contiguous' if args.contiguous else 'interleaved'} slots; kernel "
          f"{cpu_lora.cpu_kernel_isa()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for T in args.tokens:
            ids = np.arange(T) % args.adapters
            slots = np.sort(ids) if args.contiguous else ids
            mapping = LoRAMapping()
            mapping.set(slots, torch.device("cpu"))
            xs = {a.shape[2]: torch.randn(T, a.shape[2]) for a, _ in stacks}
            ys = [torch.zeros(T, b.shape[1]) for _, b in stacks]

            def kernel() -> None:
                for (a, b), y in zip(stacks, ys):
                    op(y, xs[a.shape[2]], a, b, mapping.groups.token_slots)

            def torch_path() -> None:
                for (a, b), y in zip(stacks, ys):
                    add_lora_torch(y, xs[a.shape[2]], a, b, mapping.groups)

            tk, tt = [], []
            for _ in range(args.iters):     # alternate, so load hits both alike
                tk.append(best_ms(kernel, 1))
                tt.append(best_ms(torch_path, 1))
            k, t = min(tk), min(tt)
            print(f"threads {threads} T {T:4d}: torch {t:7.2f} ms  C++ {k:7.2f} ms  "
                  f"speedup {t / k:5.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="demo")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--contiguous", action="store_true")
    run(p.parse_args())


if __name__ == "__main__":
    main()
