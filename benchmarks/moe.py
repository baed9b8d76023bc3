"""A random Mixtral-style mixture-of-experts model: kvserve `LLM.generate` against Hugging Face
`generate` and against its dense equivalent on kvserve (a Llama of the same attention and depth
whose MLP is top_k experts wide: the same active parameters), alternating rounds; offline
throughput and batch-1 decode tokens/s; the weight bytes a batch-1 decode step must read (the
ACTIVE parameters: attention, router, top-k experts, LM head; not the other experts) against
the total, and the bandwidth each decode rate implies.

Sizes (--size): "full" is issue 30's ~1B total / ~200M active (hidden 1024, 16 layers, 16
experts of intermediate 1024, top-2, vocab 32000); "small" (the default: a loaded 2-core
machine builds and runs it in minutes) is hidden 512, 8 layers, 8 experts of 512, top-2.

    python benchmarks/moe.py [--size small|full] [--dtype float32|bfloat16|auto] [--rounds 2]
        [--num-prompts 16] [--output-len 32] [--min-prompt-len 16] [--max-prompt-len 128]
        [--hf-batch-size 8 16 ...] [--output-json out.json]
        # HF runs every listed batch size each round; its offline figure is the best of them
        [--moe-path kernel|torch|both]      # kvserve's decode experts (default: both, in turn)
        [--no-dense]                        # skip the dense equivalent
    python benchmarks/moe.py --kernel-sweep [--size ...]   # one layer: kernel vs torch GEMMs
    python benchmarks/moe.py --gguf Q8_0 [Q4_0 Q4_K ...] [--size ...] [--rounds 3]
        # the checkpoint as a GGUF file of that type (every matrix; router, norms F32):
        # batch-1 decode with the experts kept packed vs the same file dequantized
        # (--quantization gguf-dequantized), both engines loaded, alternating rounds
    python benchmarks/moe.py --kernel-sweep --gguf Q8_0 ...   # one layer's decode step:
        # packed experts (fused_experts_packed) vs only its int8 kernel calls vs float32

--gguf K-quants (Q4_K, Q5_K, Q6_K): gguf's package has no quantizer for them, so those files
hold random blocks (random quants, small random scales): a random model either way.
Measured 2026-11-26, Zen 3 EPYC 2 cores AVX2, loaded (load 3.5-4.9), GOMP_SPINCOUNT=0, medians of
3 rounds (full: 2), batch-1 decode packed vs dequantized tok/s: small Q8_0 107 vs 41, Q4_0 109
vs 67, Q4_K 146 vs 56; full Q4_K 34.7 vs 8.7 (95 vs 670 MiB of weights a token).

--dtype auto: a bf16 checkpoint run with dtype="auto" (on a CPU without bf16 math: weights, the
experts included, stay bf16 in memory, math and KV cache float32), HF in float32 on it.

On a host shared with other busy processes, batch-1 numbers depend on libgomp's waiting (see
omp_env; e.g. `GOMP_SPINCOUNT=0 python benchmarks/moe.py ...` for both sides): it is printed.

Bytes per token at batch 1 cannot be counted directly here; "implied GB/s" = active weight
bytes x decode tok/s is what a step that streams only the routed experts would need, to be
read against the machine's measured read bandwidth (printed).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_vs_hf import hf_batch1_decode, make_requests  # noqa: E402
from roofline import (DEFAULT_MODEL_DIR, kv_cache_bytes_for, machine_description,  # noqa: E402
                      measure_memory_bandwidth)

from kvserve.benchmarks.throughput import load_hf_model, run_hf, run_kvserve  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=512, num_local_experts=8,
                  num_experts_per_tok=2, vocab_size=32000),
    "full": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=1024, num_local_experts=16,
                 num_experts_per_tok=2, vocab_size=32000),
}


def ensure_moe_checkpoint(size: str, dtype: str, model_dir: str) -> str:
    """A random MixtralForCausalLM written by transformers (+ the demo tokenizer), built once."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from kvserve.model.demo import train_demo_tokenizer

    path = os.path.join(model_dir, f"mixtral-{size}-random-{dtype}-v1")
    if os.path.isfile(os.path.join(path, "model.safetensors")) or \
            os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return path
    tmp = path + f".tmp-{os.getpid()}"
    config = MixtralConfig(**SIZES[size], max_position_embeddings=2048, bos_token_id=1,
                           eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(tmp)
    train_demo_tokenizer(tmp, model_max_length=2048)
    os.replace(tmp, path)
    return path


def ensure_dense_checkpoint(size: str, dtype: str, model_dir: str) -> str:
    """The MoE's dense equivalent: a random Llama of the same attention, vocabulary and depth
    whose one MLP has top_k x the expert width (the same active parameters but the router's),
    built once. What the MoE's speed is read against: a dense model that reads as much."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvserve.model.demo import train_demo_tokenizer

    path = os.path.join(model_dir, f"mixtral-{size}-dense-equivalent-{dtype}-v1")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    c = SIZES[size]
    config = LlamaConfig(hidden_size=c["hidden_size"], num_hidden_layers=c["num_hidden_layers"],
                         num_attention_heads=c["num_attention_heads"],
                         num_key_value_heads=c["num_key_value_heads"],
                         intermediate_size=c["num_experts_per_tok"] * c["intermediate_size"],
                         vocab_size=c["vocab_size"], max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    tmp = path + f".tmp-{os.getpid()}"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(tmp)
    train_demo_tokenizer(tmp, model_max_length=2048)
    os.replace(tmp, path)
    return path


def checkpoint_dtype(dtype: str) -> str:
    """The checkpoint's dtype for --dtype ("auto": a bf16 checkpoint)."""
    return "bfloat16" if dtype == "auto" else dtype


def math_dtype(dtype: str) -> str:
    """HF's dtype, and kvserve's activations / KV cache ("auto" on a CPU without bf16 math:
    float32)."""
    from kvserve.ops import cpu_isa
    if dtype != "auto":
        return dtype
    return "bfloat16" if cpu_isa.has_native_bf16() else "float32"


def omp_env() -> str:
    """libgomp's waiting settings (read when torch loads): on a host shared with other busy
    processes every parallel region's join can wait for a worker thread kept off its core, and
    GOMP_SPINCOUNT=0 (sleep at once, woken with priority) changes batch-1 decode several-fold."""
    return " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                                     "GOMP_SPINCOUNT") if k in os.environ) \
        or "libgomp defaults"


def uptime() -> str:
    """The load average (the machine is shared: numbers are read beside it)."""
    try:
        with open("/proc/loadavg") as f:
            return "load average " + " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def param_bytes(size: str, dtype: str) -> dict[str, int]:
    """Total weight bytes, and those a batch-1 decode step reads (one embedding row aside)."""
    c = SIZES[size]
    h, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    head = h // c["num_attention_heads"]
    attn = h * head * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    expert = 3 * h * inter
    router = h * c["num_local_experts"]
    lm_head = embed = c["vocab_size"] * h
    per_el = torch.finfo(getattr(torch, checkpoint_dtype(dtype))).bits // 8
    total = layers * (attn + router + c["num_local_experts"] * expert) + embed + lm_head
    active = layers * (attn + router + c["num_experts_per_tok"] * expert) + lm_head
    dense = active - layers * router      # the dense equivalent's batch-1 bytes
    return {"total_params": total, "active_params": active,
            "total_bytes": total * per_el, "active_bytes": active * per_el,
            "dense_active_bytes": dense * per_el}


def read_bandwidth_gb_s(device: str) -> float:
    """The bandwidth batch-1 decode is read against: the CPU's measured read bandwidth, or
    on CUDA a device-to-device copy's (bytes read + written, as benchmarks/gpu.py counts)."""
    if device == "cuda":
        from gpu import copy_bandwidth_gb_s
        return copy_bandwidth_gb_s()
    return measure_memory_bandwidth(256)["read_gb_s"]


# A round's entries that are not a side's measurements.
ROUND_INFO = ("uptime", "read_gb_s")


def kvserve_round(path: str, dtype: str, requests: list, args: argparse.Namespace,
                  kernel: bool = True) -> dict:
    """One kvserve run; `kernel`: the C++ fused-experts kernel for decode steps, else the
    grouped torch GEMMs for every step (the engine core runs in this process, so the switch
    reaches it; every other C++ kernel stays on)."""
    from kvserve import LLM
    from kvserve.benchmarks.latency import measure_decode_throughput
    from kvserve.ops import moe as moe_ops

    lens = [r.prompt_len + r.expected_output_len for r in requests]
    moe_ops.set_kernel_enabled(kernel)
    llm = LLM(path, dtype=dtype, max_model_len=max(lens) + 80, max_num_seqs=len(requests),
              kv_cache_memory=kv_cache_bytes_for(path, math_dtype(dtype), lens + [96]), seed=0,
              multiprocessing=False, device=args.device)
    try:
        elapsed, out = run_kvserve(requests, llm, temperature=0.0)
        b1 = measure_decode_throughput(llm, 1, 32, args.batch1_tokens, num_iters=2)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        moe_ops.set_kernel_enabled(True)
    return {"output_tok_s": sum(out) / elapsed, "batch1_tok_s": b1["decode_tokens_per_second"]}


def hf_round(path: str, dtype: str, requests: list, args: argparse.Namespace) -> dict:
    """HF generate at each --hf-batch-size; its offline figure is the best of them (HF's
    throughput peaks at some batch: larger ones pad more and, with every expert routed,
    stop amortising the weights)."""
    hf = load_hf_model(path, getattr(torch, math_dtype(dtype)), args.device)
    try:
        by_batch = {}
        for bs in args.hf_batch_size:
            elapsed, out = run_hf(requests, hf, bs)
            by_batch[bs] = sum(out) / elapsed
        print("  HF offline tok/s by batch size: " + ", ".join(
            f"{bs}: {v:.1f}" for bs, v in by_batch.items()), flush=True)
        b1 = hf_batch1_decode(hf, 32, args.batch1_tokens, SIZES[args.size]["vocab_size"], 2)
    finally:
        del hf
        gc.collect()
    return {"output_tok_s": max(by_batch.values()), "batch1_tok_s": b1,
            "by_batch_size": by_batch}


def run(args: argparse.Namespace) -> dict[str, Any]:
    path = ensure_moe_checkpoint(args.size, checkpoint_dtype(args.dtype), args.model_dir)
    requests = make_requests(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                             args.output_len, SIZES[args.size]["vocab_size"], seed=0)
    result: dict[str, Any] = {"machine": machine_description(), "size": args.size,
                              "omp_env": omp_env(),
                              "dtype": args.dtype, **param_bytes(args.size, args.dtype),
                              "read_gb_s": read_bandwidth_gb_s(args.device),
                              "rounds": []}
    # The kernel switch picks the CPU's C++ kernel or torch's GEMMs; CUDA always runs Triton.
    sides = {"kernel": True} if args.device == "cuda" else {"kernel": True, "torch": False}
    sides = {name: (path, flag) for name, flag in sides.items()
             if args.moe_path in (name, "both")}
    if args.dense:
        dense = ensure_dense_checkpoint(args.size, checkpoint_dtype(args.dtype), args.model_dir)
        sides["dense"] = (dense, True)
    for r in range(args.rounds):      # alternating: drift on a shared host hits all sides
        # The read bandwidth again each round on CPU: some hosts switch between bandwidth
        # modes (48 / 79 GB/s on the Zen 5 host) and batch-1 decode follows them.
        rd: dict[str, Any] = {"read_gb_s": read_bandwidth_gb_s(args.device)
                              if r and args.device == "cpu" else result["read_gb_s"]}
        rd.update({f"kvserve_{name}": kvserve_round(p, args.dtype, requests, args, flag)
                   for name, (p, flag) in sides.items()})
        rd["hf"] = hf_round(path, args.dtype, requests, args)
        rd["uptime"] = uptime()
        result["rounds"].append(rd)
        print(f"round {r} ({rd['uptime']}; read {rd['read_gb_s']:.1f} GB/s): " + " | ".join(
            f"{side} {v['output_tok_s']:.1f} tok/s, batch-1 {v['batch1_tok_s']:.1f}"
            for side, v in rd.items() if side not in ROUND_INFO), flush=True)
    names = [k for k in result["rounds"][0] if k not in ROUND_INFO]
    best = {side: {m: max(rd[side][m] for rd in result["rounds"])
                   for m in ("output_tok_s", "batch1_tok_s")} for side in names}
    result["best"] = best
    result["median"] = {side: {m: statistics.median(rd[side][m] for rd in result["rounds"])
                               for m in ("output_tok_s", "batch1_tok_s")} for side in names}
    med = result["median"]
    for side in names:          # ratios of the medians over rounds
        if side == "hf":
            continue
        result[f"{side}_throughput_ratio"] = med[side]["output_tok_s"] / med["hf"]["output_tok_s"]
        result[f"{side}_throughput_ratio_rounds"] = [
            rd[side]["output_tok_s"] / rd["hf"]["output_tok_s"] for rd in result["rounds"]]
        result[f"{side}_batch1_ratio"] = med[side]["batch1_tok_s"] / med["hf"]["batch1_tok_s"]
        nbytes = result["dense_active_bytes" if side == "kvserve_dense" else "active_bytes"]
        result[f"{side}_batch1_implied_gb_s"] = med[side]["batch1_tok_s"] * nbytes / 1e9
        result[f"{side}_batch1_bandwidth_share_rounds"] = [
            rd[side]["batch1_tok_s"] * nbytes / 1e9 / rd["read_gb_s"] for rd in result["rounds"]]
        if side != "kvserve_dense" and "kvserve_dense" in med:
            result[f"{side}_vs_dense"] = {
                m: med[side][m] / med["kvserve_dense"][m] for m in ("output_tok_s", "batch1_tok_s")}
    return result


# ---- GGUF files: packed experts vs dequantized -------------------------------------------

def _gguf_blocks(t: torch.Tensor, qtype: str, seed: int) -> np.ndarray:
    """t [..., K] as `qtype` blocks: gguf's quantizer, or random blocks for the K-quants."""
    import gguf
    from gguf.quants import quantize

    from kvserve.ops.quant import block_format

    q = gguf.GGMLQuantizationType[qtype]
    try:
        return quantize(t.float().numpy(), q)
    except NotImplementedError:
        fmt = block_format(qtype)
        rng = np.random.default_rng(seed)
        rows = int(np.prod(t.shape[:-1]))
        raw = rng.integers(0, 256, (rows, t.shape[-1] // fmt.block_size, fmt.type_size),
                           dtype=np.uint8)
        scales = rng.uniform(0, 4e-5, raw.shape[:2]).astype(np.float16)
        at = 208 if qtype == "Q6_K" else 0
        raw[..., at:at + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
        if qtype in ("Q4_K", "Q5_K"):
            raw[..., 2:4] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)     # dmin
        return raw.reshape(*t.shape[:-1], -1)


def ensure_moe_gguf(ckpt: str, qtype: str) -> str:
    """The random Mixtral as llama.cpp's converter writes it ("llama" + expert_count, q / k
    rows permuted, experts stacked [E, ...]), every matrix `qtype`, router and norms F32."""
    import gguf
    from safetensors.torch import load_file
    from vs_llamacpp import _vocab, permute_qk

    out = os.path.join(ckpt, f"model-{qtype}.gguf")
    if os.path.isfile(out):
        return out
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    layers, n_head, n_kv = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                            cfg["num_key_value_heads"])
    head_dim, experts = cfg["hidden_size"] // n_head, cfg["num_local_experts"]
    w = gguf.GGUFWriter(out + ".tmp", "llama")
    for add, v in ((w.add_block_count, layers), (w.add_context_length, 2048),
                   (w.add_embedding_length, cfg["hidden_size"]),
                   (w.add_feed_forward_length, cfg["intermediate_size"]),
                   (w.add_head_count, n_head), (w.add_head_count_kv, n_kv),
                   (w.add_key_length, head_dim), (w.add_value_length, head_dim),
                   (w.add_rope_dimension_count, head_dim), (w.add_vocab_size, cfg["vocab_size"]),
                   (w.add_expert_count, experts),
                   (w.add_expert_used_count, cfg["num_experts_per_tok"]),
                   (w.add_bos_token_id, 1), (w.add_eos_token_id, 2)):
        add(v)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or 1e6))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    tokens, types, merges = _vocab(ckpt, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    stacks: dict[str, list] = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if ".experts." in name:         # model.layers.L.block_sparse_moe.experts.E.wN.weight
            p = name.split(".")
            part = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}[p[6]]
            stacks.setdefault(f"blk.{p[2]}.{part}.weight", [None] * experts)[int(p[5])] = t
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if "q_proj" in name or "k_proj" in name:
            t = permute_qk(t, n_head if "q_proj" in name else n_kv)
        if t.dim() < 2 or gname.endswith("ffn_gate_inp.weight"):
            w.add_tensor(gname, t.float().numpy())
        else:
            w.add_tensor(gname, _gguf_blocks(t, qtype, i),
                         raw_dtype=gguf.GGMLQuantizationType[qtype])
    for i, (gname, ts) in enumerate(sorted(stacks.items())):
        w.add_tensor(gname, _gguf_blocks(torch.stack(ts), qtype, 10_000 + i),
                     raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(out + ".tmp", out)
    return out


def gguf_active_bytes(size: str, qtype: str) -> dict[str, float]:
    """Weight bytes a batch-1 decode step reads: packed (the type's bytes a weight; router F32)
    and dequantized (float32 everywhere)."""
    from kvserve.ops.quant import block_format

    per = param_bytes(size, "float32")
    c = SIZES[size]
    router = c["num_hidden_layers"] * c["hidden_size"] * c["num_local_experts"]
    bpw = block_format(qtype).type_size / block_format(qtype).block_size
    return {"packed": (per["active_params"] - router) * bpw + router * 4,
            "dequantized": per["active_bytes"]}


def gguf_decode(size: str, qtypes: list[str], args: argparse.Namespace) -> list[dict]:
    """Per type: batch-1 decode tok/s, packed experts vs the file dequantized, both engines
    loaded in this process, measured in alternating rounds (median and best)."""
    from kvserve import LLM
    from kvserve.benchmarks.latency import measure_decode_throughput

    ckpt = ensure_moe_checkpoint(size, "float32", args.model_dir)
    results = []
    for qtype in qtypes:
        path = ensure_moe_gguf(ckpt, qtype)
        llms = {q: LLM(path, quantization=q, dtype="float32", max_model_len=256, seed=0,
                       kv_cache_memory=64 << 20, multiprocessing=False)
                for q in ("gguf", "gguf-dequantized")}
        rates: dict[str, list[float]] = {q: [] for q in llms}
        try:
            for r in range(args.rounds):
                for q, llm in llms.items():
                    try:
                        rates[q].append(measure_decode_throughput(
                            llm, 1, 32, args.batch1_tokens, num_iters=2)
                            ["decode_tokens_per_second"])
                    except RuntimeError as e:        # a round drowned in the host's noise
                        print(f"  {qtype} {q}: {e}", flush=True)
                        rates[q].append(float("nan"))
                print(f"  {qtype} round {r} ({uptime()}): packed {rates['gguf'][-1]:.1f} tok/s, "
                      f"dequantized {rates['gguf-dequantized'][-1]:.1f} tok/s", flush=True)
        finally:
            for llm in llms.values():
                llm.shutdown()
            del llms
            gc.collect()
        nbytes = gguf_active_bytes(size, qtype)
        row = {"qtype": qtype, "file_bytes": os.path.getsize(path)}
        for q, side in (("gguf", "packed"), ("gguf-dequantized", "dequantized")):
            got = [v for v in rates[q] if v == v] or [float("nan")]
            med = statistics.median(got)
            row[side] = {"tok_s_median": med, "tok_s_best": max(got),
                         "bytes_per_token": nbytes[side],
                         "implied_gb_s": med * nbytes[side] / 1e9}
        results.append(row)
    return results


def packed_sweep(size: str, qtypes: list[str], tokens: tuple[int, ...] = (1, 2, 4, 8),
                 layers: int = 8) -> list[dict]:
    """One layer's decode step with packed experts: fused_experts_packed (the model's path,
    the C++ op) against the same in torch ops (the Python loop), only the int8 kernel calls it
    makes from Python, and the float32 C++ kernel on the dequantized experts; weights of
    `layers` layers cycled so each call reads its experts from memory."""
    from kvserve.model.layers.fused_moe import select_experts
    from kvserve.model.layers.fused_moe.packed import (PackedExperts, _experts_loop,
                                                       fused_experts_packed)
    from kvserve.model.layers.fused_moe.torch_moe import group_by_expert
    from kvserve.ops import moe as moe_ops
    from kvserve.ops.fused import silu_and_mul
    from kvserve.ops.quant import kernel as quant_kernel
    from kvserve.ops.quant.weight import QuantizedRows

    c = SIZES[size]
    E, H, inter, k = (c["num_local_experts"], c["hidden_size"], c["intermediate_size"],
                      c["num_experts_per_tok"])
    ops, rows = quant_kernel.ops(), []
    gen = torch.Generator().manual_seed(0)
    for qtype in qtypes:
        stacks = []
        for layer in range(layers):
            w13 = torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5
            w2 = torch.randn(E, H, inter, generator=gen) / inter ** 0.5
            p13, p2 = (PackedExperts.stack([[QuantizedRows(qtype, _gguf_blocks(w[e], qtype, e),
                                                           tuple(w.shape[1:]))]
                                             for e in range(E)]) for w in (w13, w2))
            f13 = torch.stack([p13.expert(e).dequantize() for e in range(E)])
            f2 = torch.stack([p2.expert(e).dequantize() for e in range(E)])
            stacks.append((p13, p2, f13, f2))

        def kernel_only(x, p13, p2, weights, ids):
            _, _, counts = group_by_expert(ids, E)
            for e, n in enumerate(counts):
                if n:
                    xe = x[:n]
                    a = silu_and_mul(ops.linear(xe, p13.packed[e], p13.fmt.ggml_type, 2 * inter))
                    ops.linear(a, p2.packed[e], p2.fmt.ggml_type, H)

        sides = {"packed": lambda x, s, w, i: fused_experts_packed(x, [s[0]], s[1], w, i, E),
                 "python_loop": lambda x, s, w, i: _experts_loop(x, [s[0]], s[1], w, i, E, ops),
                 "int8_calls_only": lambda x, s, w, i: kernel_only(x, s[0], s[1], w, i),
                 "float32_kernel": lambda x, s, w, i: moe_ops.fused_moe_cpu(x, s[2], s[3], w, i)}
        for T in tokens:
            x = torch.randn(T, H, generator=gen)
            weights, ids = select_experts(torch.randn(T, E, generator=gen), k, True)
            routed = int(torch.unique(ids).numel())
            times = {}
            for name, fn in sides.items():
                fn(x, stacks[0], weights, ids)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for s in stacks:
                        fn(x, s, weights, ids)
                    best = min(best, (time.perf_counter() - t0) / layers)
                times[name] = best * 1e3
            rows.append({"qtype": qtype, "tokens": T, "routed": routed,
                         **{f"{n}_ms": t for n, t in times.items()},
                         "packed_bytes": routed * (stacks[0][0].nbytes + stacks[0][1].nbytes) // E})
            r = rows[-1]
            print(f"  {qtype} T={T} experts={routed}: packed {r['packed_ms']:.3f} ms "
                  f"({r['packed_bytes'] / r['packed_ms'] / 1e6:.1f} GB/s), Python loop "
                  f"{r['python_loop_ms']:.3f} ms, int8 calls only "
                  f"{r['int8_calls_only_ms']:.3f} ms, float32 kernel {r['float32_kernel_ms']:.3f} "
                  f"ms", flush=True)
    return rows


def kernel_sweep(size: str, dtypes: list[str],
                 pairs: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
                 layers: int = 8) -> list[dict]:
    """One MoE layer's experts at the size's shapes: the C++ kernel against the grouped torch
    GEMMs per step of T tokens (T * k pairs), weights of `layers` layers cycled so each call
    reads its experts from memory, not cache. The crossover sets ops/moe.py's
    MAX_DECODE_PAIRS (float32) and MAX_DECODE_PAIRS_DPBF16 (bf16 on dpbf16). bf16 on a dpbf16
    build also times the panel-packed layout (ops/moe.py pack_panels), which FusedMoE keeps
    there for every step size. Also each kernel call's implied GB/s (routed experts' bytes /
    time)."""
    from kvserve.model.layers.fused_moe import fused_experts_torch, select_experts
    from kvserve.ops import moe as moe_ops

    c = SIZES[size]
    E, H, inter, k = (c["num_local_experts"], c["hidden_size"], c["intermediate_size"],
                      c["num_experts_per_tok"])
    rows = []
    for dtype in dtypes:
        wd = xd = getattr(torch, dtype)
        gen = torch.Generator().manual_seed(0)
        ws = [((torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5).to(wd),
               (torch.randn(E, H, inter, generator=gen) / inter ** 0.5).to(wd))
              for _ in range(layers)]
        sides = {"kernel": (moe_ops.fused_moe_cpu, ws), "torch": (fused_experts_torch, ws)}
        if moe_ops.panels_fit(*ws[0], wd):
            sides["panels"] = (moe_ops.fused_moe_cpu, [moe_ops.pack_panels(*w) for w in ws])
        for p in pairs:
            T = max(1, p // k)
            x = torch.randn(T, H, generator=gen).to(xd)
            weights, ids = select_experts(torch.randn(T, E, generator=gen), k, True)
            routed = int(torch.unique(ids).numel())
            times = {name: _best_layer_time(fn, stacks, x, weights, ids)
                     for name, (fn, stacks) in sides.items()}
            nbytes = routed * 3 * H * inter * torch.finfo(wd).bits // 8
            rows.append({"dtype": dtype, "pairs": T * k, "tokens": T, "routed": routed,
                         **{f"{name}_ms": t * 1e3 for name, t in times.items()},
                         "speedup": times["torch"] / times["kernel"],
                         "kernel_gb_s": nbytes / times["kernel"] / 1e9})
            r = rows[-1]
            panels = ""
            if "panels" in times:
                tp = times["panels"]
                panels = (f", panels {tp * 1e3:.3f} ms ({nbytes / tp / 1e9:.1f} GB/s, "
                          f"{times['kernel'] / tp:.2f}x kernel, {times['torch'] / tp:.2f}x torch)")
            print(f"  {dtype:9s} T={T:4d} pairs={T * k:4d} experts={routed:2d}: kernel "
                  f"{r['kernel_ms']:.3f} ms ({r['kernel_gb_s']:.1f} GB/s), torch "
                  f"{r['torch_ms']:.3f} ms -> {r['speedup']:.2f}x{panels}", flush=True)
    return rows


def _best_layer_time(fn: Any, stacks: list, x: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> float:
    """Seconds per layer: best of 3 passes over every layer's stacks (after a warm-up)."""
    fn(x, *stacks[0], weights, ids)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for w13, w2 in stacks:
            fn(x, w13, w2, weights, ids)
        best = min(best, (time.perf_counter() - t0) / len(stacks))
    return best


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                   help="auto: a bf16 checkpoint, kvserve dtype=auto, HF float32 (on a CPU "
                        "without bf16 math)")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: kvserve and HF both on the GPU (use --dtype bfloat16)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-prompt-len", type=int, default=16,
                   help="prompt lengths uniform in [min, max] (offline_vs_hf.py's workload: "
                        "--num-prompts 64 --min-prompt-len 32 --max-prompt-len 512 "
                        "--output-len 128)")
    p.add_argument("--max-prompt-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, nargs="+", default=[8],
                   help="HF generate's batch sizes, each run in every round; HF's offline "
                        "tok/s is the best of them")
    p.add_argument("--batch1-tokens", type=int, default=32)
    p.add_argument("--output-json", default=None)
    p.add_argument("--moe-path", choices=["kernel", "torch", "both"], default="both",
                   help="kvserve's decode experts: the C++ kernel, the grouped torch GEMMs, "
                        "or each in turn in every round")
    p.add_argument("--no-dense", dest="dense", action="store_false",
                   help="skip the dense equivalent (a Llama of the same active parameters, on "
                        "kvserve in every round)")
    p.add_argument("--kernel-sweep", action="store_true",
                   help="only time one layer's experts: C++ kernel vs grouped torch GEMMs")
    p.add_argument("--gguf", nargs="+", default=None, metavar="TYPE",
                   help="GGUF files of these types (Q8_0, Q4_0, Q4_K, ...): packed experts vs "
                        "the file dequantized (with --kernel-sweep: one layer's decode step)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    start = time.perf_counter()
    if args.gguf:
        print(f"{args.size} MoE GGUF on {machine_description()}; {uptime()}; {omp_env()}")
        rows = (packed_sweep(args.size, args.gguf) if args.kernel_sweep
                else gguf_decode(args.size, args.gguf, args))
        for r in rows if not args.kernel_sweep else []:
            print(f"  {r['qtype']} ({r['file_bytes'] / 2**20:.0f} MiB file): " + "; ".join(
                f"{side} {r[side]['tok_s_median']:.1f} tok/s (best {r[side]['tok_s_best']:.1f}), "
                f"{r[side]['bytes_per_token'] / 2**20:.1f} MiB/token -> "
                f"{r[side]['implied_gb_s']:.1f} GB/s" for side in ("packed", "dequantized")))
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    if args.kernel_sweep:
        print(f"{args.size} MoE layer on {machine_description()}; uptime: {uptime()}")
        rows = kernel_sweep(args.size, ["float32", "bfloat16"])
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    result = run(args)
    print(f"{args.size} MoE ({result['total_params'] / 1e6:.0f}M total, "
          f"{result['active_params'] / 1e6:.0f}M active, {args.dtype}) on {result['machine']}; "
          f"{uptime()}; {result['omp_env']}")
    print(f"  batch-1 active weights {result['active_bytes'] / 2**20:.0f} MiB of "
          f"{result['total_bytes'] / 2**20:.0f} MiB per token; measured read bandwidth "
          f"{result['read_gb_s']:.1f} GB/s; {time.perf_counter() - start:.0f} s")
    print("  medians over rounds:")
    for side in (k for k in result["median"] if k != "hf"):
        gb_s = result[f"{side}_batch1_implied_gb_s"]
        rounds = " ".join(f"{x:.2f}" for x in result[f"{side}_throughput_ratio_rounds"])
        share = statistics.median(result[f"{side}_batch1_bandwidth_share_rounds"])
        print(f"  {side}: offline throughput / HF = {result[f'{side}_throughput_ratio']:.2f}x "
              f"(rounds {rounds}); batch-1 decode {result['median'][side]['batch1_tok_s']:.1f} "
              f"tok/s ({result[f'{side}_batch1_ratio']:.2f}x HF) -> {gb_s:.1f} GB/s implied; "
              f"each round against its read bandwidth: median {100 * share:.0f}%")
        if f"{side}_vs_dense" in result:
            vs = result[f"{side}_vs_dense"]
            print(f"    vs the dense equivalent on kvserve: offline {vs['output_tok_s']:.2f}x, "
                  f"batch-1 {vs['batch1_tok_s']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
