"""Speculative decoding: decode speed with and without it, back to back in one process.

Workloads (greedy, ignore_eos; tok/s = output tokens / wall time of `generate`):
- batch 1, random prompt, ~110M random Llama (roofline.py): plain vs n-gram;
- batch 1, repetitive prompt (a phrase repeated) on the same model: plain vs n-gram;
- batch 1, copy task on the real demo model (SmolLM2-135M-Instruct, GGUF): the answer repeats
  the prompt's code, as in code editing — plain vs n-gram;
- batch 1, draft model: a small random draft (2 layers, hidden 256, same vocabulary) and the
  target as its own draft (every draft accepted: the machinery's overhead);
- batch 32, random prompts (low acceptance): plain vs n-gram with the adaptive rule (default
  config) and with it off;
- batch 1, EAGLE: a random EAGLE-Llama head for the same model (acceptance ~0: the head's
  cost per step with the adaptive rule off, and with it on, which should stop drafting);
- sweep (only with --only sweep): batch 1, 2, 4, 8, 16 random prompts, n-gram with the rule
  off and with the cost rule but no batch-size cap (to choose disable_by_batch_size).

--dtype auto runs a bfloat16 copy of the checkpoint (made once, beside it) with dtype="auto", as
a real bf16 checkpoint is served (the issue's bf16 run; on a CPU without bf16 instructions the
math is emulated); draft and EAGLE checkpoints load in the target's compute dtype.

    python benchmarks/spec_decode.py [--dtype float32|auto] [--max-tokens 96] [--batch 32]
                                     [--repeats 3] [--live] [--skip-demo] [--only ...]
                                     [--sweep 1,2,4]
                                     [--output-json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.roofline import (DEFAULT_MODEL_DIR, ensure_bench_model,  # noqa: E402
                                 ensure_checkpoint_as)
from kvserve import LLM, SamplingParams  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
KV_CACHE_MEMORY = 512 << 20
NO_ADAPT = {"disable_by_batch_size": None, "min_acceptance_rate": 0.0}
CODE = '''def merge_sorted(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''


def ensure_small_draft(model_dir: str = DEFAULT_MODEL_DIR) -> str:
    """A random 2-layer Llama with the benchmark model's vocabulary (and tokenizer)."""
    import shutil

    from kvserve.model.demo import build_random_checkpoint
    path = os.path.join(model_dir, "llama-draft-random-v1")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        tmp = path + f".tmp-{os.getpid()}"
        build_random_checkpoint(tmp, arch="llama", hidden_size=256, num_layers=2, num_heads=4,
                                num_kv_heads=4, intermediate_size=512, vocab_size=32000,
                                max_position_embeddings=2048, tie_word_embeddings=False,
                                dtype="float32", seed=1)
        target = ensure_bench_model(model_dir)
        for name in os.listdir(target):
            if name.startswith("tokenizer") or name == "special_tokens_map.json":
                shutil.copy(os.path.join(target, name), tmp)
        os.replace(tmp, path)
    return path


def ensure_eagle_head(model_dir: str = DEFAULT_MODEL_DIR) -> str:
    """A random EAGLE-Llama head (vLLM's layout: fc.weight, layers.0.*) for the bench model."""
    import torch
    from safetensors.torch import save_file

    path = os.path.join(model_dir, "llama-eagle-random-v1")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    with open(os.path.join(ensure_bench_model(model_dir), "config.json")) as f:
        cfg = json.load(f)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg.get("num_key_value_heads",
                                                     cfg["num_attention_heads"]) * hd
    gen = torch.Generator().manual_seed(2)
    shapes = {"fc.weight": (h, 2 * h), "self_attn.q_proj.weight": (q, h),
              "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h),
              "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    tensors = {(n if n == "fc.weight" else "layers.0." + n):
               0.02 * torch.randn(shape, generator=gen) for n, shape in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    tmp = path + f".tmp-{os.getpid()}"
    os.makedirs(tmp)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({**cfg, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle"]}, f)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def median_ci95(xs: list[float]) -> Optional[tuple[float, float]]:
    """A distribution-free 95% confidence interval of the median of `xs` (order statistics:
    the widest symmetric pair [x_(k), x_(n+1-k)] that leaves at most 2.5% in each binomial
    tail). None below 6 samples, where no such pair reaches 95%. One round's ratio spreads by
    tens of % on a shared host; this says how many rounds a 3% question needs."""
    n = len(xs)
    ys = sorted(xs)
    tail, k = 0.0, 0      # P(Binomial(n, 1/2) < k), k = 0, 1, ...
    while True:
        p_k = math.comb(n, k) / 2 ** n
        if tail + p_k > 0.025:
            break
        tail += p_k
        k += 1
    return None if k == 0 else (ys[k - 1], ys[n - k])


def make_llm(model: str, dtype: str, spec: Optional[dict], warmup: list[Any], **kw: Any) -> LLM:
    # A fixed KV pool: the default (a share of free memory) would differ from run to run.
    llm = LLM(model, dtype=dtype, max_model_len=1024, seed=0, speculative_config=spec,
              kv_cache_memory=KV_CACHE_MEMORY, **kw)
    # Warm-up: long enough for the rule's first t0 steps to pass and the proposer to run once
    # (its first forward's one-off costs stay out of the timed runs).
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return llm


def timed(llm: LLM, prompts: list[Any], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return wall, [o.outputs[0].token_ids for o in outs]


def compare(name: str, model: str, prompts: list[Any], args: argparse.Namespace,
            variants: dict[str, Optional[dict]], **kw: Any) -> dict:
    """`--repeats` rounds; each round times every variant once, in an order rotated every
    round, each on a fresh engine (--live: on one engine per variant, made before the first
    round and kept for all). This machine's speed drifts by tens of % within minutes
    (and once a single engine instance ran 40% slower than its neighbours for a whole
    comparison), so a variant is compared with the plain run of the same round: the reported
    ratio is the median of the per-round ratios, tok/s the median of the rounds."""
    labels = list(variants)
    walls: dict[str, list[float]] = {label: [] for label in labels}
    tokens: dict[str, list] = {}
    spec_stats: dict[str, list[dict]] = {label: [] for label in labels}
    keep_alive = getattr(args, "live", False)
    live = ({label: make_llm(model, args.dtype, variants[label], prompts[:1], **kw)
             for label in labels} if keep_alive else {})
    for rep in range(args.repeats):
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            llm = (live[label] if keep_alive
                   else make_llm(model, args.dtype, variants[label], prompts[:1], **kw))
            before = llm.get_stats().get("spec_decoding")
            wall, tokens[label] = timed(llm, prompts, args.max_tokens)
            after = llm.get_stats().get("spec_decoding")
            if not keep_alive:
                llm.shutdown()
            walls[label].append(wall)
            if after:   # the timed run's own counts (the warm-up's taken out)
                spec_stats[label].append({k: after[k] - (before or {}).get(k, 0)
                                          for k in ("num_drafts", "num_draft_tokens",
                                                    "num_accepted_tokens")})
    for llm in live.values():
        llm.shutdown()
    rows = {}
    for label in labels:
        n = sum(len(t) for t in tokens[label])
        ratios = [walls["plain"][i] / walls[label][i] for i in range(args.repeats)]
        r = {"tok_s": n / statistics.median(walls[label]),
             "tok_s_rounds": [n / w for w in walls[label]],
             "ratio_vs_plain": statistics.median(ratios),
             "ratio_ci95": median_ci95(ratios),
             "ratio_rounds": ratios, "same_tokens": tokens[label] == tokens["plain"]}
        total = {k: sum(st[k] for st in spec_stats[label])
                 for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        if total["num_drafts"]:
            r["mean_acceptance_length"] = 1 + total["num_accepted_tokens"] / total["num_drafts"]
            r["acceptance_rate"] = total["num_accepted_tokens"] / total["num_draft_tokens"]
        if spec_stats[label]:
            r["num_drafts_rounds"] = [st["num_drafts"] for st in spec_stats[label]]
        rows[label] = r
    print(f"\n{name} ({args.repeats} rounds)")
    for label, r in rows.items():
        acc = (f", mean acceptance length {r['mean_acceptance_length']:.2f}, acceptance "
               f"{100 * r['acceptance_rate']:.0f}%, drafts per round {r['num_drafts_rounds']}"
               if "mean_acceptance_length" in r else "")
        spread = ("/".join(f"{x:.2f}" for x in r["ratio_rounds"]) if args.repeats <= 9 else
                  f"rounds {min(r['ratio_rounds']):.2f}-{max(r['ratio_rounds']):.2f}")
        if r["ratio_ci95"] and label != "plain":
            spread += ", 95% CI of the median {:.3f}-{:.3f}".format(*r["ratio_ci95"])
        print(f"  {label:<26} {r['tok_s']:7.1f} tok/s  x{r['ratio_vs_plain']:.3f} ({spread})"
              f"  same tokens: {r['same_tokens']}{acc}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="float32",
                   help='a torch dtype, or "auto": a bfloat16 copy of the checkpoint')
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds per comparison (variants interleaved; medians reported)")
    p.add_argument("--live", action="store_true",
                   help="one engine per variant, alive for all rounds (its adaptive rule keeps "
                        "what it learned, as a server's does); default: a fresh engine per "
                        "variant per round")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--only", default=None,
                   help="comma list: random,repetitive,demo,draft,eagle,batch,sweep "
                        "(sweep: only if named)")
    p.add_argument("--sweep", default="1,2,4,8,16", help="batch sizes of the sweep workload")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    only = set(args.only.split(",")) if args.only else None
    model = ensure_bench_model()
    if args.dtype == "auto":
        model = ensure_checkpoint_as(model, "bfloat16")
    rng = random.Random(0)
    random_prompt = [{"prompt_token_ids": [rng.randrange(100, 32000) for _ in range(32)]}]
    phrase = [rng.randrange(100, 32000) for _ in range(12)]
    repetitive = [{"prompt_token_ids": phrase * 6}]
    results: dict[str, Any] = {"cpu": platform.processor() or platform.machine(),
                               "dtype": args.dtype, "max_tokens": args.max_tokens}
    ng = {"plain": None, "ngram": NGRAM}
    if only is None or "random" in only:
        results["batch1_random"] = compare("batch 1, random prompt", model, random_prompt,
                                           args, ng)
    if only is None or "repetitive" in only:
        results["batch1_repetitive"] = compare("batch 1, repetitive prompt", model, repetitive,
                                               args, ng)
    if not args.skip_demo and (only is None or "demo" in only):
        copy = [{"prompt": "<|im_start|>user\nRepeat this code exactly, without any change:\n\n"
                           + CODE + "<|im_end|>\n<|im_start|>assistant\n"}]
        results["batch1_demo_copy"] = compare("batch 1, copy task, demo model (SmolLM2-135M)",
                                              "demo", copy, args, ng)
    if only is None or "draft" in only:
        results["batch1_draft_model"] = compare(
            "batch 1, draft model", model, random_prompt, args,
            {"plain": None,
             "small draft (adaptive)": {"method": "draft_model", "model": ensure_small_draft(),
                                        "num_speculative_tokens": 3},
             "target as own draft": {"method": "draft_model", "model": model,
                                     "num_speculative_tokens": 3}})
    if only is None or "eagle" in only:
        eagle = {"method": "eagle", "model": ensure_eagle_head(), "num_speculative_tokens": 3}
        results["batch1_eagle"] = compare(
            "batch 1, random EAGLE head (acceptance ~0)", model, random_prompt, args,
            {"plain": None, "eagle (adaptive)": eagle,
             "eagle (no adaptive rule)": {**eagle, **NO_ADAPT}})
    if only is None or "batch" in only:
        prompts = [{"prompt_token_ids": [rng.randrange(100, 32000) for _ in range(32)]}
                   for _ in range(args.batch)]
        results[f"batch{args.batch}_random"] = compare(
            f"batch {args.batch}, random prompts (low acceptance)", model, prompts, args,
            {"plain": None, "ngram (adaptive)": NGRAM, "ngram (no adaptive rule)":
             {**NGRAM, **NO_ADAPT}})
    if only is not None and "sweep" in only:   # where drafting stops paying, by batch size
        for b in (int(x) for x in args.sweep.split(",")):
            prompts = [{"prompt_token_ids": [rng.randrange(100, 32000) for _ in range(32)]}
                       for _ in range(b)]
            results[f"sweep_batch{b}"] = compare(
                f"batch {b}, random prompts", model, prompts, args,
                {"plain": None, "ngram (no adaptive rule)": {**NGRAM, **NO_ADAPT},
                 "ngram (cost rule, no batch cap)": {**NGRAM, "disable_by_batch_size": None}})
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
