"""Quantized weights on a GPU (issue 29 part 3's benchmark): GGUF blocks kept packed (Triton
kernels, kvserve/ops/triton/quant.py) and online fp8 (kvserve/ops/fp8.py). Not a test.

Model: a random ~1B Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192,
vocab 8192), bfloat16 safetensors, built once under --model-dir, and two GGUF files made from
it once: Q8_0 (every 2-D tensor) and Q4_K_M (llama.cpp's mix: Q4_K, with Q6_K for the output
and for attn_v / ffn_down of the layers llama.cpp's use_more_bits picks). `gguf` has no K-quant
quantizer, so this script writes the Q4_K / Q6_K / Q8_0 blocks itself (plain min/max scales,
torch on the GPU; the values read back through gguf's own dequantizer are checked).

1. kernel level: the GEMV (batch 1) on the 1B's linear shapes for every packed type, captured
   in a CUDA graph over enough weight copies that nothing stays in L2: GB/s of the packed bytes
   and % of the measured device-to-device copy bandwidth; bf16 F.linear and fp8 (_scaled_mm +
   its per-token quantization) beside it; at M = 16, 64, 512 rows the packed weights'
   default path (dequantized to bf16, then cuBLAS) and the tl.dot kernel, in TFLOP/s next to
   bf16 cuBLAS and fp8;
2. batch-1 decode (prefill excluded) of the model as bf16, fp8, Q8_0 and Q4_K_M: tok/s, the
   bytes a step streams (linear weights and the LM head in the layout kvserve keeps; the
   embedding is one row) and % of the limit copy bandwidth / those bytes;
3. offline throughput (--num-prompts requests, random prompts, greedy, EOS ignored) of each.

Goals on an H100: Q4_K_M / Q8_0 and fp8 batch-1 decode >= 60% of the limit; fp8 offline
throughput >= 1.3x bf16's. About 3-4 minutes (the first run also builds the files).

    python benchmarks/quant_gpu.py [--model-dir DIR] [--variants bf16 fp8 Q8_0 Q4_K_M]
        [--num-prompts 200] [--skip-kernels] [--gemv-sweep] [--skip-e2e]
        [--async-scheduling] [--output-json results/quant_gpu.json]

`--smoke`: tiny shapes and a tiny model, on CPU under TRITON_INTERPRET=1 when no GPU is there
(GGUF files load through the CPU path there; fp8 records its start-up error): checks that the
script runs; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import numpy as np
import torch

if not torch.cuda.is_available():       # before triton's kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu import MODEL_CONFIG as GPU_MODEL_CONFIG  # noqa: E402
from benchmarks.gpu import MODEL_NAME as GPU_MODEL_NAME  # noqa: E402
from benchmarks.gpu import (batch1_decode, copy_bandwidth_gb_s, decode_step_profile,  # noqa: E402
                            make_requests)
from benchmarks.roofline import DEFAULT_MODEL_DIR, ensure_random_checkpoint  # noqa: E402
from kvserve.benchmarks.throughput import run_kvserve  # noqa: E402
from kvserve.ops.quant import FORMATS, PACKED_TYPES, PackedQuantWeight  # noqa: E402

# The same checkpoint as benchmarks/gpu.py's (one name, one config: whichever script builds it
# first, the other finds it as it expects).
MODEL_CONFIG, MODEL_NAME = GPU_MODEL_CONFIG, GPU_MODEL_NAME
SMOKE_CONFIG: dict[str, Any] = dict(
    arch="llama", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=512, vocab_size=1024, max_position_embeddings=1024,
    tie_word_embeddings=False, dtype="bfloat16", seed=0)
SMOKE_NAME = "llama-smoke-random-bf16-v2"   # vocab past the tokenizer, as the 1B
GOAL_BATCH1, GOAL_FP8_SPEEDUP = 0.60, 1.3
VARIANTS = ("bf16", "fp8", "Q8_0", "Q4_K_M")
# --gemv-sweep: (rows per program, K splits) timed beside the default (_gemv_config's).
GEMV_SWEEP = ((8, 1), (8, 2), (8, 4), (16, 1), (16, 2), (32, 1))


# ------------------------------------------------------------------------------------------
# GGUF blocks written with torch (the values are checked against gguf's dequantizer)

def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).contiguous().view(torch.uint8).reshape(*t.shape, 2)


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K / 32 * 34] uint8: d = max|x| / 127, q = round(x / d)."""
    n, k = w.shape
    x = w.float().reshape(n, k // 32, 32)
    d = (x.abs().amax(-1) / 127).half().float()
    q = _safe_div(x, d.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return torch.cat((_f16_bytes(d), q.view(torch.uint8)), -1).reshape(n, -1)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K / 256 * 144] uint8: per 32-weight sub-block scale (max - min) / 15 and
    minimum, 6-bit each against the super-block's d / dmin (float16)."""
    n, k = w.shape
    x = w.float().reshape(n, k // 256, 8, 32)
    lo = x.amin(-1).clamp(max=0)
    scale, mins = (x.amax(-1) - lo) / 15, -lo
    d = (scale.amax(-1) / 63).half().float()
    dmin = (mins.amax(-1) / 63).half().float()
    sc = _safe_div(scale, d.unsqueeze(-1)).round().clamp(0, 63)
    mn = _safe_div(mins, dmin.unsqueeze(-1)).round().clamp(0, 63)
    eff, off = (d.unsqueeze(-1) * sc).unsqueeze(-1), (dmin.unsqueeze(-1) * mn).unsqueeze(-1)
    q = _safe_div(x + off, eff).round().clamp(0, 15).to(torch.uint8)      # [N, nb, 8, 32]
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    scales = torch.cat(((sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                        (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)), -1)
    q = q.reshape(n, k // 256, 4, 2, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, k // 256, 128)
    return torch.cat((_f16_bytes(d), _f16_bytes(dmin), scales, qs), -1).reshape(n, -1)


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K / 256 * 210] uint8: per 16-weight group an int8 scale against the
    super-block's d; q in [-32, 31] stored + 32 as 4 low bits (ql) and 2 high bits (qh)."""
    n, k = w.shape
    nb = k // 256
    x = w.float().reshape(n, nb, 16, 16)
    gs = x.abs().amax(-1) / 31
    d = (gs.amax(-1) / 127).half().float()
    sc = _safe_div(gs, d.unsqueeze(-1)).round().clamp(-128, 127)
    eff = (d.unsqueeze(-1) * sc).unsqueeze(-1)
    q = (_safe_div(x, eff).round().clamp(-32, 31) + 32).to(torch.uint8).reshape(n, nb, 256)
    q2 = q.reshape(n, nb, 2, 2, 64)
    ql = ((q2[:, :, :, 0] & 15) | ((q2[:, :, :, 1] & 15) << 4)).reshape(n, nb, 128)
    q4 = (q.reshape(n, nb, 2, 4, 32) >> 4) & 3
    qh = (q4[:, :, :, 0] | (q4[:, :, :, 1] << 2) | (q4[:, :, :, 2] << 4)
          | (q4[:, :, :, 3] << 6)).reshape(n, nb, 64)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat((ql, qh, scales, _f16_bytes(d)), -1).reshape(n, -1)


QUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": quantize_q8_0, "Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return (layer < n_layers // 8 or layer >= 7 * n_layers // 8
            or (layer - n_layers // 8) % 3 == 2)


def q4_k_m_type(hf_name: str, n_layers: int) -> str:
    if hf_name == "lm_head.weight":
        return "Q6_K"
    if ".v_proj." in hf_name or ".down_proj." in hf_name:
        layer = int(hf_name.split(".layers.")[1].split(".")[0])
        return "Q6_K" if _use_more_bits(layer, n_layers) else "Q4_K"
    return "Q4_K"


def check_quantizers(device: str) -> dict[str, float]:
    """Each quantizer read back by gguf's dequantizer: max error / max |w| per type."""
    from kvserve.ops.quant.reference import dequantize_gguf
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(0))
    w[3] *= 50.0
    out = {}
    for name, fn in QUANTIZERS.items():
        raw = fn(w.to(device)).cpu().numpy()
        back = dequantize_gguf(raw, FORMATS[name], tuple(w.shape))
        rows = np.abs(back - w.numpy()).max(1) / np.abs(w.numpy()).max(1)
        limit = {"Q8_0": 0.01, "Q6_K": 0.03, "Q4_K": 0.1}[name]
        if not (rows <= limit).all():
            raise AssertionError(f"{name} blocks read back {rows.max():.3g} off (> {limit})")
        out[name] = round(float(rows.max()), 5)
    return out


def ensure_gguf(ckpt: str, ftype: str, device: str) -> str:
    """`ckpt` as a GGUF file of `ftype` (Q8_0 or Q4_K_M), written once beside it."""
    import gguf
    from safetensors import safe_open

    from tests.model.gguf_files import (GGUF_ARCH, _add_tokenizer, add_model_header,
                                        llamacpp_permute)

    out = f"{ckpt}-{ftype}.gguf"
    if os.path.isfile(out):
        return out
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    arch = GGUF_ARCH[cfg["architectures"][0]]
    n_layers, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    tmp = out + f".tmp-{os.getpid()}"
    w = gguf.GGUFWriter(tmp, arch)
    add_model_header(w, cfg, n_kv, head_dim, float(cfg.get("rope_theta", 10000.0)))
    _add_tokenizer(w, ckpt, "default")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if "q_proj" in name:
                t = llamacpp_permute(t, n_head)
            elif "k_proj" in name:
                t = llamacpp_permute(t, n_kv)
            if t.dim() != 2:
                w.add_tensor(gguf_name, t.float().numpy())
                continue
            qtype = "Q8_0" if ftype == "Q8_0" else q4_k_m_type(name, n_layers)
            raw = QUANTIZERS[qtype](t.to(device)).cpu().numpy()
            w.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------------------------------
# 1. kernels

def _linear_shapes(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_heads"]
    return [("qkv", (cfg["num_heads"] + 2 * cfg["num_kv_heads"]) * hd, h), ("o", h, h),
            ("gate_up", 2 * i, h), ("down", h, i)]


def _random_packed(name: str, n: int, k: int, device: str, seed: int) -> PackedQuantWeight:
    fmt = FORMATS[name]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(n, k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    sc = np.frombuffer(g.uniform(-0.02, 0.02, raw.shape[:2]).astype(np.float16).tobytes(),
                       np.uint8).reshape(*raw.shape[:2], 2)
    if name == "Q6_K":
        raw[..., 208:210] = sc
    else:
        raw[..., 0:2] = raw[..., 2:4] = sc
    return PackedQuantWeight.from_gguf(name, raw.reshape(n, -1), (n, k)).to(device)


def _time_graph(calls: list[Callable[[], Any]], iters: int, device: str) -> float:
    """Seconds per call: the calls captured in one CUDA graph, replayed `iters` times (on
    CPU: a plain loop, one round)."""
    if device != "cuda":       # one plain round (the interpreter: a smoke run)
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) / len(calls)
    for c in calls:            # compile / warm up outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters / len(calls)


def _copies(nbytes: int, smoke: bool) -> int:
    return 2 if smoke else max(2, -(-(400 << 20) // max(nbytes, 1)))    # > 8x an H100's L2


def kernel_bench(cfg: dict[str, Any], args: argparse.Namespace, bw: Optional[float]
                 ) -> dict[str, Any]:
    from kvserve.ops import fp8
    from kvserve.ops.triton.quant import quant_matmul

    dev, res = args.device, {}
    dt = torch.bfloat16
    for label, n, k in _linear_shapes(cfg)[1:2] if args.smoke else _linear_shapes(cfg):
        x1 = torch.randn(1, k, device=dev, dtype=dt)
        row: dict[str, Any] = {"N": n, "K": k}
        for name in args.types:
            if k % FORMATS[name].block_size:
                continue
            w0 = _random_packed(name, n, k, dev, seed=1)
            ws = [w0] + [PackedQuantWeight(w0.fmt, w0.shape, w0.packed.clone())
                         for _ in range(_copies(w0.nbytes, args.smoke) - 1)]
            outs = [torch.empty(1, n, device=dev, dtype=dt) for _ in ws]
            s = _time_graph([lambda w=w, o=o: quant_matmul(x1, w.packed, w.fmt, n, out=o)
                             for w, o in zip(ws, outs)], args.iters, dev)
            if args.smoke:       # the kernel's values, once
                ref = x1.float() @ w0.dequantize().t()
                assert torch.allclose(outs[0].float(), ref, rtol=2e-2, atol=2e-2 * float(
                    ref.abs().max()))
            row[name] = _bw_entry(w0.nbytes, s, bw)
            for gcfg in (GEMV_SWEEP if args.gemv_sweep else ()):
                s = _time_graph([lambda w=w, o=o: quant_matmul(x1, w.packed, w.fmt, n, out=o,
                                                               gemv_config=gcfg)
                                 for w, o in zip(ws, outs)], args.iters, dev)
                row[f"{name}@{gcfg[0]}x{gcfg[1]}"] = _bw_entry(w0.nbytes, s, bw)
            del ws, outs
        wb = [torch.randn(n, k, device=dev, dtype=dt) * 0.02
              for _ in range(_copies(n * k * 2, args.smoke))]
        row["bf16"] = _bw_entry(n * k * 2, _time_graph(
            [lambda w=w: torch.nn.functional.linear(x1, w) for w in wb], args.iters, dev), bw)
        w8 = [fp8.quantize_weight(w) for w in wb]
        row["fp8"] = _bw_entry(n * k, _time_graph(
            [lambda w=w: fp8.fp8_linear(x1, *w) for w in w8], args.iters, dev), bw)
        del wb, w8
        res[label] = row
        _free(dev)
    res["prefill"] = prefill_bench(cfg, args)
    return res


def _bw_entry(nbytes: int, seconds: float, bw: Optional[float]) -> dict[str, float]:
    gbs = nbytes / seconds / 1e9
    out = {"us": seconds * 1e6, "GB_s": gbs}
    if bw:
        out["pct_copy_bw"] = 100 * gbs / bw
    return out


def prefill_bench(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The tl.dot kernel at M rows on gate_up, TFLOP/s, beside bf16 cuBLAS and fp8."""
    from kvserve.ops import fp8
    from kvserve.ops.triton.quant import quant_matmul

    dev = args.device
    _, n, k = _linear_shapes(cfg)[1 if args.smoke else 2]
    out: dict[str, Any] = {"N": n, "K": k}
    packed = {name: _random_packed(name, n, k, dev, seed=2) for name in ("Q4_K", "Q8_0")}
    wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    wq = fp8.quantize_weight(wb)
    for m in ((17,) if args.smoke else (16, 64, 512)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        flops, row = 2 * m * n * k, {}
        for name, w in packed.items():          # the default (dequantize + cuBLAS), tl.dot
            for path in ("dequant", "dot"):
                s = _time_graph([lambda w=w, p=path: quant_matmul(x, w.packed, w.fmt, n, path=p)],
                                args.iters, dev)
                row[f"{name}_{path}"] = {"us": s * 1e6, "TFLOP_s": flops / s / 1e12}
        s = _time_graph([lambda: torch.nn.functional.linear(x, wb)], args.iters, dev)
        row["bf16"] = {"us": s * 1e6, "TFLOP_s": flops / s / 1e12}
        s = _time_graph([lambda: fp8.fp8_linear(x, *wq)], args.iters, dev)
        row["fp8"] = {"us": s * 1e6, "TFLOP_s": flops / s / 1e12}
        out[f"M{m}"] = row
    return out


# ------------------------------------------------------------------------------------------
# 2. / 3. the model

def streamed_bytes(variant: str, ckpt: str, path: str) -> int:
    """Bytes one decode step reads: the linear weights and the LM head as kvserve keeps them
    (GGUF: the packed layout, 8-row groups; K-quants with their decoded scales), not the
    embedding (one row per token)."""
    if variant.startswith("Q"):
        from gguf import GGUFReader
        total = 0
        for t in GGUFReader(path).tensors:
            if t.name == "token_embd.weight":
                continue
            if t.tensor_type.name in PACKED_TYPES:
                fmt = FORMATS[t.tensor_type.name]
                k, n = int(t.shape[0]), int(np.prod(t.shape[1:]))
                total += -(-n // 8) * (k // fmt.block_size) * fmt.group_block_bytes
            else:
                total += int(t.n_elements) * 2          # float tensors: the model's bf16
        return total
    from safetensors import safe_open
    total = 0
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "embed_tokens" in name:
                continue
            shape = f.get_slice(name).get_shape()
            numel = int(np.prod(shape))
            fp8_linear = variant == "fp8" and len(shape) == 2 and "lm_head" not in name
            total += numel + 4 * shape[0] if fp8_linear else numel * 2
    return total


def model_bench(variant: str, ckpt: str, args: argparse.Namespace, requests: list,
                bw: Optional[float]) -> dict[str, Any]:
    from kvserve import LLM
    path = ckpt if variant in ("bf16", "fp8") else ensure_gguf(ckpt, variant, args.device)
    kw: dict[str, Any] = dict(dtype="bfloat16" if args.device == "cuda" else "float32",
                              device=args.device, max_model_len=args.max_model_len,
                              max_num_seqs=256, multiprocessing=False)
    if variant == "fp8":
        kw["quantization"] = "fp8"
    if args.async_scheduling:
        kw["async_scheduling"] = True
    try:
        llm = LLM(path, **kw)
    except ValueError as e:             # fp8 where the device has none: the start-up error
        return {"error": str(e)}
    res: dict[str, Any] = {"bytes_per_step": streamed_bytes(variant, ckpt, path)}
    res["batch1_tok_s"] = batch1_decode(llm, requests[0].prompt_token_ids, args.batch1_len)
    # GPU busy against wall per batch-1 step: is the step the GPU's or the host's?
    res["decode_step"] = decode_step_profile(llm, requests[0].prompt_token_ids, 16, args.device)
    if bw:
        limit = bw * 1e9 / res["bytes_per_step"]
        res.update(batch1_limit_tok_s=limit, batch1_fraction=res["batch1_tok_s"] / limit)
    elapsed, outs = run_kvserve(requests, llm)
    res["throughput_tok_s"] = sum(outs) / elapsed
    del llm
    _free(args.device)
    return res


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------

def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--types", nargs="+", default=list(PACKED_TYPES), choices=PACKED_TYPES,
                   help="packed types of the kernel-level GEMV table")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--min-prompt-len", type=int, default=128)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch1-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20, help="graph replays per kernel timing")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="also time the GEMV at each of GEMV_SWEEP's (rows, K splits)")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engines of part 2 / 3 with --async-scheduling")
    p.add_argument("--output-json", default=None)
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and model; CPU (Triton interpreter) without a GPU")
    args = p.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.num_prompts, args.output_len, args.batch1_len, args.iters = 4, 8, 8, 1
        args.min_prompt_len, args.max_prompt_len, args.max_model_len = 8, 16, 256
        args.types = ["Q8_0", "Q4_K"]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.device != "cuda" and not args.smoke:
        print("benchmarks/quant_gpu.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    name, cfg = (SMOKE_NAME, SMOKE_CONFIG) if args.smoke else (MODEL_NAME, MODEL_CONFIG)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "model": cfg, "smoke": args.smoke,
        "quantizer_check": check_quantizers(args.device)}
    bw = copy_bandwidth_gb_s() if args.device == "cuda" else None
    result["copy_bandwidth_gb_s"] = bw
    if not args.skip_kernels:
        result["kernels"] = _guarded(lambda: kernel_bench(cfg, args, bw))
        _save(result, args.output_json, "kernels")
    if not args.skip_e2e:
        ckpt = ensure_random_checkpoint(name, cfg, args.model_dir)
        requests = make_requests(args.num_prompts, args.min_prompt_len, args.max_prompt_len,
                                 args.output_len, cfg["vocab_size"])
        result["models"] = {}
        for v in args.variants:
            result["models"][v] = _guarded(lambda v=v: model_bench(v, ckpt, args, requests, bw))
            _save(result, args.output_json, v)
    summarize(result)
    return 0


def _save(result: dict[str, Any], path: Optional[str], done: str) -> None:
    """The JSON so far, after each part: a run stopped by a time limit keeps what it had."""
    print(f"[{done} done] {json.dumps(result.get('models', {}).get(done, ''), default=str)}",
          flush=True)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2, default=str)


def _guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:                                    # noqa: BLE001 - record and go on
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def summarize(result: dict[str, Any]) -> None:
    bw = result.get("copy_bandwidth_gb_s")
    print(f"{result['device']} (torch {result['torch']})"
          + (f", copy bandwidth {bw:.0f} GB/s" if bw else ""))
    print(f"  quantizers read back by gguf: max error / max|w| {result['quantizer_check']}")
    kern = result.get("kernels") or {}
    if "error" in kern:
        print(f"  kernels: FAILED {kern['error']}")
    for label, row in kern.items():
        if label == "prefill" or label == "error":
            continue
        cells = [f"{k} {v['us']:.1f} us {v['GB_s']:.0f} GB/s"
                 + (f" ({v['pct_copy_bw']:.0f}%)" if "pct_copy_bw" in v else "")
                 for k, v in row.items() if isinstance(v, dict)]
        print(f"  GEMV M=1 {label} [{row['N']}x{row['K']}]: " + "; ".join(cells))
    pre = kern.get("prefill")
    if isinstance(pre, dict) and "error" not in pre:
        for mk, row in ((k, v) for k, v in pre.items() if isinstance(v, dict)):
            print(f"  GEMM {mk} [{pre['N']}x{pre['K']}]: " + "; ".join(
                f"{k} {v['us']:.0f} us {v['TFLOP_s']:.1f} TFLOP/s" for k, v in row.items()))
    models = result.get("models") or {}
    for v, r in models.items():
        if "error" in r:
            print(f"  {v:7s}: {r['error']}")
            continue
        frac = (f" = {100 * r['batch1_fraction']:.0f}% of {r['batch1_limit_tok_s']:.0f} "
                f"(goal {100 * GOAL_BATCH1:.0f}%)" if "batch1_fraction" in r else "")
        d = r.get("decode_step", {})
        step = (f" (a step: GPU busy {d['gpu_busy_ms_per_step']:.2f} ms, wall "
                f"{d['wall_ms_per_step']:.2f} ms, {d['kernels_per_step']:.0f} kernels)" if d else "")
        print(f"  {v:7s}: batch-1 {r['batch1_tok_s']:.0f} tok/s{frac}{step}, "
              f"{r['bytes_per_step'] / 2**20:.0f} MiB/step | offline "
              f"{r['throughput_tok_s']:.0f} tok/s")
    b, f = models.get("bf16", {}), models.get("fp8", {})
    if "throughput_tok_s" in b and "throughput_tok_s" in f:
        result["fp8_vs_bf16_throughput"] = f["throughput_tok_s"] / b["throughput_tok_s"]
        print(f"  fp8 / bf16 offline throughput {result['fp8_vs_bf16_throughput']:.2f}x "
              f"(goal {GOAL_FP8_SPEEDUP}x)")


if __name__ == "__main__":
    sys.exit(main())
