"""Multi-LoRA offline throughput: kvserve with 1, 4 and 16 distinct rank-16 adapters against
base-only, the adapter load time, and PEFT's `generate` as the peer, same model and prompts.

The model is the benchmark Llama (benchmarks/roofline.py, ~110M parameters, float32); the
adapters are PEFT LoRA adapters (rank 16, lora_alpha 32, on q/k/v/o/gate/up/down, random
non-zero A and B) saved by peft under --model-dir. The workload: --num-prompts requests,
prompt lengths uniform in --prompt-len (min, max), --output-len tokens each, greedy, EOS
ignored; request i uses adapter i mod N. kvserve runs with --max-loras N (all adapters in
one batch) and an engine without LoRA gives the base-only number; the ratios are taken
against base requests on the LoRA engine (no LoRA work) in the same round (--rounds). The peer runs PEFT's model with the
adapters loaded and `generate(adapter_names=...)` (PEFT's mixed-batch inference) in batches
of --hf-batch-size (on the first --peft-prompts requests, default all).

Issue 33's goals: >= 0.8x base-only with 4 adapters; >= 4x PEFT on CPU.

The default (16 prompts of 16..64 tokens, 32 output tokens: every adapter count still runs
one batch of 16 requests) is sized for a 2-core CPU; --full is the larger workload (32
prompts of 64..256 tokens, 64 output tokens). On a machine loaded by other jobs, make it
smaller still (e.g. --output-len 16 --prompt-len 16 32): the ratios are what it measures.
Decode steps of up to 16 rows (the default workload's) run in the fused all-layers C++ op
(kvserve.model.layers.fused_decode), LoRA included. Each timed run starts with an empty prefix
cache (the rounds reuse the prompts), and PEFT runs once per round: the vs-PEFT ratio is the
median of each round's 4-adapter run over that round's PEFT run.

    python benchmarks/lora.py [--full] [--num-prompts N] [--output-len N] [--adapters 1 4 16]
        [--lora-dtype auto|bfloat16]
        [--hf-batch-size 16] [--peft-prompts N] [--skip-peft] [--output-json out.json]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import (DEFAULT_MODEL_DIR, bench_main, ensure_bench_model,  # noqa: E402
                      machine_description)

from kvserve import LLM, LoRARequest, SamplingParams  # noqa: E402

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ensure_adapters(model_path: str, count: int, model_dir: str) -> list[str]:
    """`count` PEFT adapters for the benchmark model, built once with peft and reused."""
    root = os.path.join(model_dir, f"{os.path.basename(model_path)}-lora-r{RANK}")
    paths = [os.path.join(root, f"adapter{i}") for i in range(count)]
    missing = [i for i, p in enumerate(paths)
               if not os.path.isfile(os.path.join(p, "adapter_model.safetensors"))]
    if missing:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS,
                                                init_lora_weights=False))
        for i in missing:
            gen = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            model.save_pretrained(paths[i])
    return paths


def make_prompts(n: int, vocab: int, lens: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(*lens))] for _ in range(n)]


def run_kvserve(llm: LLM, prompts: list[list[int]], output_len: int,
                loras: Optional[list[Optional[LoRARequest]]]) -> float:
    """Output tokens/s of one generate call with every request submitted at once."""
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:4]], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    # Every run prefills its prompts in full, as the peer does: the rounds reuse the prompts,
    # and the prefix cache (kept per adapter) would otherwise serve most of them from the last.
    assert llm.reset_prefix_cache(), "the prefix cache did not reset"
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_peft(model_path: str, adapters: list[str], prompts: list[list[int]], output_len: int,
             batch_size: int, device: str = "cpu", dtype: str = "float32") -> float:
    """PEFT's generate, left-padded batches, request i with adapter i mod len(adapters)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], 1):
        model.load_adapter(path, adapter_name=f"a{i}")
    model.to(device).eval()
    names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    start, produced = time.perf_counter(), 0
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0,
                                 adapter_names=names[b:b + batch_size])
        produced += (out.shape[1] - width) * len(batch)
    return produced / (time.perf_counter() - start)


class _Results(dict):
    """Printed as they come: a long run on a loaded machine still shows its first numbers."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or ensure_bench_model(args.model_dir)
    counts = sorted(set(args.adapters))
    paths = ensure_adapters(model, max(counts), args.model_dir)
    import json
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    prompts = make_prompts(args.num_prompts, vocab, tuple(args.prompt_len))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine = dict(dtype=dtype, max_model_len=512, multiprocessing=False, device=args.device,
                  async_scheduling=args.async_scheduling)
    result: dict[str, Any] = _Results()
    result["machine"] = machine_description()
    result["load_average"] = os.getloadavg()
    result.update(num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                  output_len=args.output_len, rank=RANK, async_scheduling=args.async_scheduling)
    # The first pass over a workload pays one-time costs: on a GPU Triton compiles kernels and
    # graphs are captured for its shapes (seconds, where a timed pass takes a fraction of
    # one); on a CPU a kernel rebuilt after a source change landed in round 0 (52 against 460
    # tok/s). So one untimed pass first (on a CPU a short one: prefill and one decode step).
    warm_len = args.output_len if args.device == "cuda" else 2
    with LLM(model, **engine) as llm:
        run_kvserve(llm, prompts, warm_len, None)
        runs = [run_kvserve(llm, prompts, args.output_len, None) for _ in range(args.rounds)]
        result["base_only_tok_s"] = statistics.median(runs)
        result["base_only_rounds_tok_s"] = runs
        if args.profile_steps:
            result["profile_base_only"] = _profile(llm, prompts, args, None)
    result["lora_dtype"] = args.lora_dtype
    with LLM(model, enable_lora=True, max_loras=max(counts), max_cpu_loras=max(counts),
             max_lora_rank=RANK, lora_dtype=args.lora_dtype, **engine) as llm:
        loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        start = time.perf_counter()
        for lr in loras:
            llm.add_lora(lr)
        result["adapter_load_s"] = (time.perf_counter() - start) / len(loras)
        # Rounds alternate base requests and each adapter count on this engine, and each
        # round's ratios use that round's base number: on a CPU shared with other jobs the
        # load moves between runs, and a ratio of two runs far apart measures the load.
        ratios: dict[int, list[float]] = {n: [] for n in counts}
        peft_ratios: list[float] = []
        for n in counts:
            run_kvserve(llm, prompts, warm_len, [loras[i % n] for i in range(len(prompts))])
        for rnd in range(args.rounds):
            base = run_kvserve(llm, prompts, args.output_len, None)
            result[f"round{rnd}_lora_engine_base_requests_tok_s"] = base
            for n in counts:
                per_req = [loras[i % n] for i in range(len(prompts))]
                tok_s = run_kvserve(llm, prompts, args.output_len, per_req)
                result[f"round{rnd}_adapters_{n}_tok_s"] = tok_s
                ratios[n].append(tok_s / base)
            if not args.skip_peft:      # the peer inside each round, against its kvserve run
                n = min(4, max(counts))
                peft = run_peft(model, paths[:n], prompts[:args.peft_prompts], args.output_len,
                                args.hf_batch_size, args.device, dtype)
                result[f"round{rnd}_peft_{n}_adapters_tok_s"] = peft
                peft_ratios.append(result[f"round{rnd}_adapters_{n}_tok_s"] / peft)
        if args.profile_steps:
            result["profile_lora_engine_base"] = _profile(llm, prompts, args, None)
            for n in counts:
                result[f"profile_adapters_{n}"] = _profile(
                    llm, prompts, args, [loras[i % n] for i in range(len(prompts))])
        if args.host_profile_dir:
            from gpu import host_profile
            os.makedirs(args.host_profile_dir, exist_ok=True)
            n = max(counts)
            for name, per_req in (("base", None), (f"adapters_{n}",
                                                   [loras[i % n] for i in range(len(prompts))])):
                host_profile(llm, prompts, args.profile_steps or 8, os.path.join(
                    args.host_profile_dir, f"lora_host_{name}.txt"), per_req)
        for n in counts:
            result[f"adapters_{n}_tok_s"] = result[f"round{args.rounds - 1}_adapters_{n}_tok_s"]
            result[f"adapters_{n}_vs_base_median"] = statistics.median(ratios[n])
    if peft_ratios:
        result["kvserve_vs_peft_median"] = statistics.median(peft_ratios)
    result["load_average_end"] = os.getloadavg()
    return result


def _profile(llm: LLM, prompts: list[list[int]], args: argparse.Namespace,
             loras: Optional[list[Optional[LoRARequest]]]) -> dict[str, Any]:
    """Per decode step of the whole batch (gpu.py's profile): kernels, GPU busy, host ms."""
    from gpu import decode_step_profile
    return decode_step_profile(llm, prompts, args.profile_steps, args.device, loras)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the benchmark Llama)")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--lora-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="kvserve's --lora-dtype (bfloat16: half the adapter bytes a step on "
                        "the float32 model; PEFT keeps float32)")
    p.add_argument("--full", action="store_true",
                   help="the larger workload: 32 prompts of 64..256 tokens, 64 output tokens")
    p.add_argument("--num-prompts", type=int, default=None, help="default 16 (--full: 32)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="default 16 64 (--full: 64 256)")
    p.add_argument("--output-len", type=int, default=None, help="default 32 (--full: 64)")
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--peft-prompts", type=int, default=None,
                   help="requests the PEFT peer runs (default: all)")
    p.add_argument("--rounds", type=int, default=2,
                   help="alternating rounds of base requests and each adapter count")
    p.add_argument("--skip-peft", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: kvserve and PEFT on the GPU, both bfloat16 (CPU: float32)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also profile this many decode steps of the whole batch (kernels per "
                        "step, GPU busy and host ms) for base-only, base requests on the LoRA "
                        "engine and each adapter count")
    p.add_argument("--async-scheduling", action="store_true",
                   help="both engines with --async-scheduling (the host prepares step N+1 "
                        "while the GPU runs step N)")
    p.add_argument("--host-profile-dir", default=None,
                   help="also write cProfiles (host time by function) of a decode run of the "
                        "whole batch on the LoRA engine: base requests, and the most adapters")
    p.add_argument("--output-json", default=None)
    return p


def run_with_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """run() after filling the sizes left unset: the default workload, or --full's."""
    full = args.full
    defaults = dict(num_prompts=32 if full else 16, prompt_len=[64, 256] if full else [16, 64],
                    output_len=64 if full else 32)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.peft_prompts is None:
        args.peft_prompts = args.num_prompts
    return run(args)


def main(argv: Optional[list[str]] = None) -> int:
    return bench_main(make_parser, run_with_defaults, argv)


if __name__ == "__main__":
    sys.exit(main())
