"""Embedding throughput: kvserve `LLM.embed` against `sentence-transformers`, same checkpoint.

Issue 34's benchmark. The model is the random ~110M-parameter decoder of issue 2's benchmarks
(Llama: hidden 768, 12 layers, 12 heads, vocab 32000), given a sentence-transformers config
(modules.json: Transformer, Pooling with last-token pooling, Normalize: a Qwen3-Embedding-style
decoder embedder) in a directory beside it. Both sides load that one directory: kvserve with
`runner="pooling"` (reading the sentence-transformers config), sentence-transformers with
`SentenceTransformer(dir)` (transformers' AutoModel under it).

Workload: --num-inputs inputs (default 64) of --input-len random token ids (default 256), one
batch. Both sides get the token ids (no tokenizer in the timing): kvserve as
`{"prompt_token_ids": ...}`, sentence-transformers as the features dict its forward takes
(input_ids + attention_mask, batch --st-batch-size, default 64). float32 on both sides.
Rounds alternate (kvserve, sentence-transformers, kvserve, ...) after one warm-up each; the
best round of each is reported as inputs/s, with their ratio (goal: >= 3x). The embeddings of
both are compared (cosine) once, so the speed is that of the same result.

    python benchmarks/embeddings.py [--rounds 3] [--num-inputs 64] [--input-len 256]
        [--model-dir benchmarks/.models] [--threads 2] [--output-json out.json]

Needs `pip install -e .[bench]` (sentence-transformers).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import DEFAULT_MODEL_DIR, ensure_bench_model, machine_description, write_json  # noqa: E402

GOAL_RATIO = 3.0


def ensure_st_model(base_dir: str, out_dir: str) -> str:
    """`base_dir`'s files (linked) plus a sentence-transformers config: last-token pooling and
    a Normalize module."""
    os.makedirs(os.path.join(out_dir, "1_Pooling"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "2_Normalize"), exist_ok=True)
    for name in os.listdir(base_dir):
        dst = os.path.join(out_dir, name)
        if not os.path.lexists(dst):
            os.symlink(os.path.abspath(os.path.join(base_dir, name)), dst)
    with open(os.path.join(base_dir, "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]
    with open(os.path.join(out_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(out_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": hidden, "pooling_mode_cls_token": False,
                   "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False,
                   "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True,
                   "include_prompt": True}, f)
    return out_dir


def run_kvserve(llm: Any, prompts: list[list[int]]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, torch.tensor([o.outputs.embedding for o in outs])


def run_st(model: Any, prompts: list[list[int]], batch_size: int) -> tuple[float, torch.Tensor]:
    device = next(model.parameters()).device
    start = time.perf_counter()
    embs = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i:i + batch_size], device=device)
            feats = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            embs.append(model(feats)["sentence_embedding"].float().cpu())
    elapsed = time.perf_counter() - start
    return elapsed, torch.cat(embs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-inputs", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--st-batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="kvserve's step budget (default: the engine's)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from kvserve import LLM

    base = ensure_bench_model(args.model_dir)
    model_dir = ensure_st_model(base, os.path.join(args.model_dir, "embed-st-" + os.path.basename(base)))
    with open(os.path.join(base, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(5, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_inputs)]

    llm = LLM(model_dir, runner="pooling", dtype="float32", multiprocessing=False,
              max_model_len=max(args.input_len, 512),
              **({"max_num_batched_tokens": args.max_num_batched_tokens}
                 if args.max_num_batched_tokens else {}))
    st = SentenceTransformer(model_dir, device="cpu", model_kwargs={"dtype": torch.float32})
    st.eval()

    _, ours = run_kvserve(llm, prompts)                       # warm-up (and the outputs)
    _, theirs = run_st(st, prompts, args.st_batch_size)
    cos = torch.nn.functional.cosine_similarity(ours, theirs).min().item()
    times: dict[str, list[float]] = {"kvserve": [], "sentence_transformers": []}
    for _ in range(args.rounds):
        times["kvserve"].append(run_kvserve(llm, prompts)[0])
        times["sentence_transformers"].append(run_st(st, prompts, args.st_batch_size)[0])
    llm.shutdown()

    rate = {k: args.num_inputs / min(v) for k, v in times.items()}
    ratio = rate["kvserve"] / rate["sentence_transformers"]
    result = {
        "machine": machine_description(), "load_average": os.getloadavg(),
        "model": model_dir, "num_inputs": args.num_inputs, "input_len": args.input_len,
        "rounds": args.rounds, "times_s": times, "inputs_per_s": rate, "ratio": ratio,
        "goal_ratio": GOAL_RATIO, "min_cosine_vs_sentence_transformers": cos,
    }
    print(f"machine: {result['machine']}; load average {result['load_average']}")
    print(f"{args.num_inputs} inputs x {args.input_len} tokens, best of {args.rounds} "
          f"alternating rounds (float32)")
    print(f"  kvserve               {rate['kvserve']:8.2f} inputs/s  "
          f"(rounds: {', '.join(f'{t:.2f}s' for t in times['kvserve'])})")
    print(f"  sentence-transformers {rate['sentence_transformers']:8.2f} inputs/s  "
          f"(rounds: {', '.join(f'{t:.2f}s' for t in times['sentence_transformers'])})")
    print(f"  ratio {ratio:.2f}x (goal >= {GOAL_RATIO}x); min cosine between the two: {cos:.6f}")
    if args.output_json:
        write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
