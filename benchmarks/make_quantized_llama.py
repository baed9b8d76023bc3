"""A random ~1B-parameter Llama as GGUF files quantized by llama.cpp's own quantizer, for
`vs_llamacpp.py --quantized-files` (issue 29's "a larger model made from a random 1B Llama").

The checkpoint: hidden 2048, 16 layers, 32 heads (8 KV heads), intermediate 5632, a 32,000-row
vocabulary (the demo's byte-level BPE tokens, padded as export_gguf pads), untied head: 0.85B
parameters, seeded N(0, 0.02) weights
(kvserve.model.demo.build_random_checkpoint), float16. It is exported to an F16 GGUF by
vs_llamacpp.export_gguf (llama.cpp's tensor names and q/k permutation), then quantized with
llama_cpp.llama_model_quantize (LLAMA_FTYPE_MOSTLY_<type>, no imatrix). Random weights: the
files are for speed and memory; their perplexity means nothing.

    python benchmarks/make_quantized_llama.py [--out benchmarks/.models] [--types Q4_K_M Q8_0]

Prints the files' paths. Needs `pip install gguf llama-cpp-python`. About 5 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import DEFAULT_MODEL_DIR  # noqa: E402
from vs_llamacpp import export_gguf  # noqa: E402

STEM = "random-llama-1b"
CONFIG = dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
              intermediate_size=5632, vocab_size=32000, max_position_embeddings=4096)


def quantize(src: str, out: str, ftype: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), (out + ".part").encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {rc}")
    os.replace(out + ".part", out)


def ensure_files(out_dir: str, types: list[str], threads: int = 2) -> list[str]:
    """The quantized files (made once; kept in out_dir with the checkpoint and the F16 file)."""
    from kvserve.model.demo import build_random_checkpoint

    ckpt = os.path.join(out_dir, STEM)
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        build_random_checkpoint(ckpt, "llama", dtype="float16", **CONFIG)
    f16 = os.path.join(out_dir, f"{STEM}.F16.gguf")
    if not os.path.isfile(f16):
        export_gguf(ckpt, f16 + ".part", "float16")
        os.replace(f16 + ".part", f16)
    paths = []
    for ftype in types:
        path = os.path.join(out_dir, f"{STEM}.{ftype}.gguf")
        if not os.path.isfile(path):
            quantize(f16, path, ftype, threads)
        paths.append(path)
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=DEFAULT_MODEL_DIR)
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for path in ensure_files(args.out, args.types, args.threads):
        print(f"{path}: {os.path.getsize(path) / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
