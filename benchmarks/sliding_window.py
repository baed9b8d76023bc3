"""KV cache memory of a sliding-window model: one request grown to 8x its window against the
same request at 1x, with the hybrid KV cache (local layers keep only their window's blocks)
and without it (--disable-hybrid-kv-cache-manager: every layer keeps every block).

The model is a random Gemma 3 text model (5 local : 1 global layers, issue 30's pattern),
built with transformers; the request is stepped one engine step at a time and the blocks it
holds in each KV cache group are read from the scheduler after every step. Bytes = blocks x
the bytes of one block (one page of each group's layers).

    python benchmarks/sliding_window.py [--window 64] [--layers 6] [--multiple 8]
        [--block-size 16] [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch


def build_model(out_dir: str, window: int, layers: int, max_len: int) -> str:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    from kvserve.model.demo import train_demo_tokenizer
    config = Gemma3TextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
        vocab_size=1024, sliding_window=window, max_position_embeddings=max_len,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float32).save_pretrained(out_dir)
    train_demo_tokenizer(out_dir, model_max_length=max_len)
    return out_dir


def run(path: str, prompt_len: int, total: int, block_size: int, hybrid: bool) -> dict[str, Any]:
    """Step one request from `prompt_len` to `total` tokens; blocks held per group by length."""
    from kvserve import LLM, SamplingParams
    llm = LLM(path, dtype="float32", max_model_len=total + block_size, block_size=block_size,
              kv_cache_memory=256 << 20, multiprocessing=False,
              disable_hybrid_kv_cache_manager=not hybrid)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager
    runner = engine.engine_core.engine_core.model_executor.worker.model_runner
    bytes_per_block = runner.kv_cache_bytes_per_block()
    engine.add_request("r", {"prompt_token_ids": [5 + i % 1000 for i in range(prompt_len)]},
                       SamplingParams(temperature=0.0, max_tokens=total - prompt_len,
                                      ignore_eos=True))
    held: dict[int, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        req = scheduler.requests.get("r")
        if req is None:
            break
        blocks = (manager.num_held_blocks("r") if hasattr(manager, "num_held_blocks")
                  else [len(manager.get_blocks("r"))])
        held[req.num_computed_tokens] = blocks
    elapsed = time.perf_counter() - start
    llm.shutdown()
    return {"held": held, "bytes_per_block": bytes_per_block,
            "decode_tok_s": (total - prompt_len) / elapsed,
            "groups": [g.spec.sliding_window for g in getattr(manager, "groups", [])]}


def local_at(result: dict[str, Any], tokens: int) -> int:
    """Bytes the local (sliding-window) groups hold at about `tokens` tokens (hybrid run)."""
    key = min(result["held"], key=lambda k: abs(k - tokens))
    groups = result["groups"]
    blocks = sum(b for b, w in zip(result["held"][key], groups) if w is not None)
    return blocks * result["bytes_per_block"]


def at(result: dict[str, Any], tokens: int) -> tuple[int, int]:
    """(blocks, bytes) held once about `tokens` tokens are computed (the nearest step; the
    last step of the request computes its second-to-last token)."""
    key = min(result["held"], key=lambda k: abs(k - tokens))
    blocks = sum(result["held"][key])
    return blocks, blocks * result["bytes_per_block"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--multiple", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    w, total = args.window, args.window * args.multiple
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(tmp, w, args.layers, total + 2 * args.block_size)
        results = {name: run(path, w // 2, total, args.block_size, hybrid)
                   for name, hybrid in (("hybrid", True), ("full", False))}
    report: dict[str, Any] = {"window": w, "layers": args.layers, "block_size": args.block_size,
                              "cpu": _cpu()}
    print(f"Gemma 3 text, {args.layers} layers (5 local : 1 global), window {w}, block "
          f"{args.block_size}; {report['cpu']}")
    for name, res in results.items():
        b1, m1 = at(res, w)
        b8, m8 = at(res, total)
        report[name] = {"blocks_at_window": b1, "blocks_at_multiple": b8, "bytes_at_window": m1,
                        "bytes_at_multiple": m8, "ratio": m8 / m1,
                        "bytes_per_block": res["bytes_per_block"],
                        "decode_tok_s": res["decode_tok_s"]}
        print(f"  {name:7s} KV at {w} tokens: {b1:4d} blocks {m1 / 2**20:7.2f} MiB; at "
              f"{total} tokens: {b8:4d} blocks {m8 / 2**20:7.2f} MiB; x{m8 / m1:.2f} "
              f"({res['decode_tok_s']:.1f} tok/s decode)")
    hybrid = results["hybrid"]
    l1, l8 = local_at(hybrid, w), local_at(hybrid, total)
    report["hybrid"].update(local_bytes_at_window=l1, local_bytes_at_multiple=l8)
    print(f"  hybrid, local layers only: {l1 / 2**20:.2f} MiB at {w} tokens, {l8 / 2**20:.2f} MiB "
          f"at {total} (x{l8 / l1:.2f})")
    saved = report["full"]["bytes_at_multiple"] / report["hybrid"]["bytes_at_multiple"]
    print(f"  at {args.multiple}x the window the hybrid KV cache holds {saved:.2f}x less")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f", {os.cpu_count()} CPUs"
    except OSError:
        pass
    return sys.platform


if __name__ == "__main__":
    main()
