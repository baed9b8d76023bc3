"""Loading the demo GGUF (SmolLM2-135M-Instruct, Q4_1) against the same weights as safetensors.

Each load runs in a fresh Python process: `LLM(model, dtype=...)` from nothing to ready to
serve (config, tokenizer, weights read and -- for GGUF -- dequantized, KV cache allocated,
kernels loaded), timed inside that process, and its peak RSS (`ru_maxrss`). GGUF runs twice:
"cold" without kvserve's cached metadata (the gguf reader parses the 49k-token vocabulary) and
"warm" with it (every later start). The safetensors checkpoint holds the GGUF's dequantized
float32 weights (written once by `dequantize_to_checkpoint`, also used by vs_llamacpp.py).

    python benchmarks/gguf_load.py [--gguf PATH] [--dtypes float32 bfloat16] [--repeats 2]
        [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import DEFAULT_MODEL_DIR, machine_description, write_json  # noqa: E402

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from kvserve import LLM
t1 = time.perf_counter()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
llm = LLM(sys.argv[1], dtype=sys.argv[2], max_model_len=512, kv_cache_memory=32 << 20,
          multiprocessing=False)
t2 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
llm.shutdown()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "rss_after_import_mb": base / 1024,
                  "peak_rss_mb": peak / 1024}))
"""


def dequantize_to_checkpoint(gguf_path: str, out_dir: str) -> str:
    """The GGUF's weights, dequantized by kvserve's loader to float32, as an HF checkpoint
    (config.json from the GGUF metadata, model.safetensors, tokenizer.json + config)."""
    from safetensors.torch import save_file

    from kvserve.model.gguf import gguf_hf_config, iterate_gguf_weights, read_gguf_metadata
    from kvserve.tokenizer import Tokenizer

    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    tmp = out_dir + f".tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    config = gguf_hf_config(read_gguf_metadata(gguf_path))
    tensors = {name: t.contiguous() for name, t in iterate_gguf_weights(gguf_path, config)}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tok = Tokenizer.from_pretrained(gguf_path)
    tok.backend_tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({**tok.special_tokens_map, "chat_template": tok.chat_template,
                   "model_max_length": tok.model_max_length}, f, indent=2)
    os.replace(tmp, out_dir)
    return out_dir


def _load_once(model: str, dtype: str, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, dtype], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    from kvserve.envs import cache_dir
    from kvserve.model.demo import fetch_demo_gguf

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=None, help="GGUF file (default: the demo model).")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=2, help="Best of this many loads.")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    gguf_path = os.path.abspath(args.gguf or fetch_demo_gguf())
    ckpt = dequantize_to_checkpoint(
        gguf_path, os.path.join(args.model_dir, os.path.basename(gguf_path)[:-5] + "-f32"))
    env = dict(os.environ)
    meta_cache = os.path.join(cache_dir(), "gguf-metadata")
    result: dict[str, Any] = {"machine": machine_description(), "gguf": gguf_path,
                              "gguf_mb": os.path.getsize(gguf_path) / 1e6,
                              "safetensors": ckpt, "runs": {}}
    _load_once(ckpt, "float32", env)                       # builds the kernels, warms caches
    for dtype in args.dtypes:
        for kind, model in (("gguf_cold", gguf_path), ("gguf_warm", gguf_path),
                            ("safetensors", ckpt)):
            runs = []
            for _ in range(args.repeats):
                if kind == "gguf_cold":
                    shutil.rmtree(meta_cache, ignore_errors=True)
                runs.append(_load_once(model, dtype, env))
            best = min(runs, key=lambda r: r["load_s"])
            result["runs"][f"{dtype}/{kind}"] = best
            print(f"{dtype:9s} {kind:12s} load {best['load_s']:6.2f} s  peak RSS "
                  f"{best['peak_rss_mb']:6.0f} MB (after import {best['rss_after_import_mb']:.0f} MB)",
                  flush=True)
    if args.output_json:
        write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
