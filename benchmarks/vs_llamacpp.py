"""kvserve against llama.cpp (through llama-cpp-python) on the same weights, same precision.

The checkpoint is exported to GGUF with the `gguf` package (`export_gguf` below: the tensor
names, the q/k row permutation and the metadata of llama.cpp's own converter, and the
byte-level BPE vocabulary padded to the model's vocabulary), in float32 and bfloat16 — the
exact values kvserve computes with. Then, per dtype, with the same number of threads:

- batch-1 decode tokens/s (greedy; after a short prompt, prefill excluded);
- prompt processing tokens/s (one prompt of --prompt-len tokens, time to its first token);
- a sanity check that the two engines agree: the greedy tokens of both on one prompt.

Both engines stay loaded and take turns, round by round, so that a drift of the memory
bandwidth during the run lands on both; the ratios are medians of the rounds' pairs.

    python benchmarks/vs_llamacpp.py [--model PATH] [--dtypes float32 bfloat16]
        [--prompt-len 512] [--decode-tokens 128] [--output-json out.json]

Without --model it uses the ~110M-parameter Llama of offline_vs_hf.py. `--model demo` (or a
.gguf path) runs kvserve on the GGUF file itself and llama.cpp on the same weights dequantized
(by kvserve's GGUF loader) and written back as F32 / BF16 GGUF; `--offline-requests N` adds
kvserve's offline throughput; `--kvserve-only` skips llama.cpp. Needs
`pip install gguf llama-cpp-python` (llama-cpp-python builds from source: about 6 minutes on
2 cores); without them the script says so and exits 0. `--export-only` writes and checks the
GGUF files without llama-cpp-python.

`--quantized-files demo a.gguf b.gguf` (issue 29) runs both engines on the same quantized
files instead (kvserve keeping them packed, its default for a .gguf): batch-1 decode tok/s and
prompt processing of --prompt-len tokens (alternating rounds), kvserve's weight memory (every
storage its model holds), the resident memory each engine adds by loading (RSS after load and
warm-up), and the perplexity of each over a fixed text (the same token ids). Each engine runs
in a process of its own, as its users run it: kvserve in-process there with the
GOMP_SPINCOUNT its import sets (as its engine core gets it), llama.cpp with the OpenMP
environment this script was started with.
`--kvserve-only` there adds kvserve's dequantized float32 path (--quantization
gguf-dequantized) as the reference instead of llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# The OpenMP settings this script was started with, before `import kvserve` adds its own
# GOMP_SPINCOUNT: llama.cpp's worker runs with these (as llama.cpp runs for its users).
_USER_OMP_ENV = {k: os.environ.get(k) for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
import time
from typing import Any, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import (DEFAULT_MODEL_DIR, ensure_bench_model, ensure_checkpoint_as,  # noqa: E402
                      load_hf_config, machine_description, write_json)

INSTALL_HINT = """\
{what} is not installed, so this comparison cannot run. Install it with

    pip install {pkg}

{extra}then run this script again."""

# "float16": llama.cpp on F16 weights against kvserve's dtype="auto" on a float16 copy of the
# checkpoint (16-bit weights, float32 math where the CPU has no bf16 instructions; issue 16).
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
FILE_TYPES = {"float32": "ALL_F32", "bfloat16": "MOSTLY_BF16", "float16": "MOSTLY_F16"}


def _missing(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is None


# ---------------------------------------------------------------------------------------------
# GGUF export

def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's rotary layout (halves) to llama.cpp's (interleaved pairs): the same
    row permutation as llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _vocab(model_path: str, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens (byte-level BPE strings), token types and merges from tokenizer.json, padded
    with unused `[PADi]` tokens up to the model's vocabulary as llama.cpp's converter does."""
    import gguf

    with open(os.path.join(model_path, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    if tok["model"]["type"] != "BPE":
        raise NotImplementedError(f"Only BPE tokenizers are exported, not {tok['model']['type']}.")
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    by_id.update(special)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in special:
            tokens.append(special[i])
            types.append(gguf.TokenType.CONTROL)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    return tokens, types, merges


def _gguf_data(t: torch.Tensor, dtype: str) -> tuple[np.ndarray, Any]:
    """A tensor's GGUF payload, cast by torch so that the values are exactly the ones kvserve
    loads; 1-D tensors (norms) are stored as float32, as llama.cpp wants, holding those values."""
    import gguf

    if dtype == "bfloat16":
        t = t.to(torch.bfloat16)
    if dtype == "float16":
        t = t.to(torch.float16)
        if t.dim() >= 2:
            return t.contiguous().numpy(), gguf.GGMLQuantizationType.F16
    if t.dim() <= 1 or dtype == "float32":
        return t.to(torch.float32).contiguous().numpy(), gguf.GGMLQuantizationType.F32
    bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    return bits.view(np.uint8), gguf.GGMLQuantizationType.BF16


def export_gguf(model_path: str, out_path: str, dtype: str = "float32") -> str:
    """Write a Llama checkpoint (Hugging Face layout) as a GGUF file llama.cpp can load."""
    import gguf
    from safetensors import safe_open

    if dtype not in GGUF_TYPES:
        raise ValueError(f"dtype must be one of {', '.join(GGUF_TYPES)}, got {dtype!r}.")
    cfg = load_hf_config(model_path)
    if cfg.get("architectures", ["?"])[0] not in ("LlamaForCausalLM", "MistralForCausalLM"):
        raise NotImplementedError(f"GGUF export handles Llama/Mistral, not {cfg.get('architectures')}.")
    if cfg.get("rope_scaling"):
        raise NotImplementedError("GGUF export of rope_scaling (rope_freqs tensor) is not implemented.")
    n_layers, n_head = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    vocab_size = int(cfg["vocab_size"])

    tmp = out_path + f".tmp-{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(os.path.basename(os.path.normpath(model_path)))
    writer.add_block_count(n_layers)
    writer.add_context_length(int(cfg["max_position_embeddings"]))
    writer.add_embedding_length(int(cfg["hidden_size"]))
    writer.add_feed_forward_length(int(cfg["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[dtype]))

    tokens, types, merges = _vocab(model_path, vocab_size)
    writer.add_tokenizer_model("gpt2")          # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id)):
        value = cfg.get(key)
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            add(int(value))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    for fname in files:
        with safe_open(os.path.join(model_path, fname), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                new_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if new_name is None:
                    raise ValueError(f"No GGUF name for tensor {name!r}.")
                t = f.get_tensor(name)
                if name.endswith("q_proj.weight"):
                    t = permute_qk(t, n_head)
                elif name.endswith("k_proj.weight"):
                    t = permute_qk(t, n_kv)
                data, qtype = _gguf_data(t, dtype)
                writer.add_tensor(new_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def check_gguf(gguf_path: str, model_path: str, dtype: str) -> int:
    """Read the GGUF back and compare every tensor with the checkpoint's (after the same
    permutation and cast); returns the number of tensors checked, raises on a mismatch."""
    import gguf
    from safetensors import safe_open

    cfg = load_hf_config(model_path)
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    reader = gguf.GGUFReader(gguf_path)
    stored = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, int(cfg["num_hidden_layers"]))
    checked = 0
    for fname in sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_path, fname), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.endswith("q_proj.weight"):
                    t = permute_qk(t, n_head)
                elif name.endswith("k_proj.weight"):
                    t = permute_qk(t, n_kv)
                want, qtype = _gguf_data(t, dtype)
                got = stored[names.get_name(name, try_suffixes=(".weight", ".bias"))]
                if [int(d) for d in reversed(got.shape)] != list(t.shape):   # GGUF lists dims reversed
                    raise AssertionError(f"GGUF shape of {name} is {list(got.shape)}, not {list(t.shape)}")
                if got.tensor_type != qtype or not np.array_equal(
                        np.asarray(got.data).reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
                    raise AssertionError(f"GGUF tensor for {name} differs from the checkpoint")
                checked += 1
    if checked != len(stored):
        raise AssertionError(f"GGUF has {len(stored)} tensors, the checkpoint {checked}")
    return checked


# ---------------------------------------------------------------------------------------------
# Measurements

class LlamaCppRunner:
    """Greedy batch-1 generation with llama.cpp on token ids, logits read for the last token
    only (`llama_get_logits_ith(ctx, -1)`; `Llama.scores` is not filled without logits_all)."""

    def __init__(self, gguf_path: str, n_ctx: int, n_threads: int) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=n_ctx,
                                   n_ubatch=n_ctx, n_threads=n_threads,
                                   n_threads_batch=n_threads, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        ptr = self._lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        return time.perf_counter() - start

    def greedy(self, prompt: list[int], num_tokens: int) -> tuple[list[int], float]:
        """The greedy tokens after `prompt`, and the seconds the decode steps took."""
        self.prefill(prompt)
        out = [self._argmax()]
        start = time.perf_counter()
        for _ in range(num_tokens - 1):
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return out, time.perf_counter() - start

    def close(self) -> None:
        self.llm.close()


class LlamaCppBatchRunner:
    """llama.cpp decoding many sequences at once, as llama-server runs its parallel slots: one
    llama_batch per step holding every sequence's next token (the prompts first, in n_batch
    chunks, logits at each prompt's last token only), a unified KV cache, greedy."""

    N_BATCH = 2048

    def __init__(self, llm: Any, n_seq: int, n_ctx_per_seq: int, n_threads: int) -> None:
        import llama_cpp

        self._lib = lib = llama_cpp
        params = lib.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_per_seq
        params.n_batch, params.n_ubatch, params.n_seq_max = self.N_BATCH, 512, n_seq
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified = True
        self.ctx = lib.llama_init_from_model(llm._model.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp: could not create the batched context")
        self.batch = lib.llama_batch_init(self.N_BATCH, 0, 1)
        self.n_vocab = llm.n_vocab()

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """entries (seq, pos, token, wants logits) -> argmax of each logits row, in order."""
        b = self.batch
        for i, (seq, pos, tok, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if self._lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        n_out = sum(e[3] for e in entries)
        ptr = self._lib.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).argmax(-1)

    def run(self, prompts: list[list[int]], num_tokens: int) -> float:
        """Seconds to generate num_tokens greedy tokens for every prompt."""
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        entries = [(s, p, t, p == len(ids) - 1) for s, ids in enumerate(prompts)
                   for p, t in enumerate(ids)]
        nxt: list[int] = []
        for i in range(0, len(entries), self.N_BATCH):
            nxt.extend(self._decode(entries[i:i + self.N_BATCH]).tolist())
        for step in range(num_tokens - 1):
            nxt = self._decode([(s, len(ids) + step, nxt[s], True)
                                for s, ids in enumerate(prompts)]).tolist()
        return time.perf_counter() - start

    def close(self) -> None:
        self._lib.llama_batch_free(self.batch)
        self._lib.llama_free(self.ctx)


def measure_offline(model: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    """kvserve offline throughput: --offline-requests random-token prompts of
    --decode-prompt-len tokens, --decode-tokens greedy output tokens each, all submitted at
    once. (llama-cpp-python runs one sequence at a time: its offline rate is its batch-1 rate.)"""
    from kvserve import LLM, SamplingParams
    from kvserve.benchmarks.latency import random_token_prompts

    llm = LLM(model, dtype=dtype, max_model_len=args.decode_prompt_len + args.decode_tokens + 16,
              enable_prefix_caching=False)
    try:
        prompts = random_token_prompts(llm, args.offline_requests, args.decode_prompt_len, seed=17)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.decode_tokens,
                                detokenize=False)
        llm.generate(prompts[:2], params, use_tqdm=False)                       # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    return {"kvserve_offline_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "offline_requests": args.offline_requests}


def _open_kvserve(model: str, dtype: str, ctx: int, entry: dict[str, Any]) -> Any:
    from kvserve import LLM

    if dtype == "float16":      # a float16 checkpoint as users get it: dtype="auto"
        llm = LLM(ensure_checkpoint_as(model, "float16"), dtype="auto", max_model_len=ctx,
                  max_num_seqs=1, enable_prefix_caching=False)
        entry["kvserve_dtype"] = (f"auto (weights {llm.llm_engine.config.model_config.weight_dtype}"
                                  f", math {llm.llm_engine.config.model_config.dtype})")
        return llm
    return LLM(model, dtype=dtype, max_model_len=ctx, max_num_seqs=1, enable_prefix_caching=False)


def bench_dtype(model: str, dtype: str, gguf_path: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both engines stay loaded and take turns round by round (the order alternates), so a
    drift of the machine's memory bandwidth (on shared hosts it moves 2x within minutes)
    lands on both sides: the ratios are the medians of each round's pair; the tok/s columns
    are each side's best round."""
    from kvserve import SamplingParams
    from kvserve.benchmarks.latency import (measure_decode_throughput,
                                            measure_prefill_throughput, random_token_prompts)

    threads = torch.get_num_threads()
    ctx = max(args.prompt_len + 1,
              args.decode_prompt_len + max(args.decode_tokens + 1, args.check_tokens)) + 16
    entry: dict[str, Any] = {"gguf": gguf_path, "threads": threads, "rounds": args.num_iters,
                             "kvserve_weights": weights_label(model, dtype),
                             "llamacpp_weights": weights_label(gguf_path, dtype)}
    if args.offline_requests:
        entry.update(measure_offline(model, dtype, args))
    llm = _open_kvserve(model, dtype, ctx, entry)
    runner = None
    try:
        check_prompt = random_token_prompts(llm, 1, args.decode_prompt_len, seed=7)[0]["prompt_token_ids"]
        ref = llm.generate([{"prompt_token_ids": check_prompt}],
                           SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.check_tokens,
                                          detokenize=False), use_tqdm=False)[0].outputs[0].token_ids
        pp_prompts = [p["prompt_token_ids"] for p in
                      random_token_prompts(llm, args.num_iters, args.prompt_len, seed=11)]
        dec_prompts = [p["prompt_token_ids"] for p in
                       random_token_prompts(llm, args.num_iters, args.decode_prompt_len, seed=13)]
        sides: dict[str, Any] = {
            "kvserve_decode": lambda i: measure_decode_throughput(
                llm, 1, args.decode_prompt_len, args.decode_tokens, 1,
                seed=1000 + 10 * i)["decode_tokens_per_second"],
            "kvserve_prefill": lambda i: measure_prefill_throughput(
                llm, args.prompt_len, 1, seed=2000 + 10 * i)["prefill_tokens_per_second"]}
        if not args.kvserve_only:
            runner = LlamaCppRunner(gguf_path, ctx, threads)
            got, _ = runner.greedy(check_prompt, args.check_tokens)
            runner.prefill(pp_prompts[0])                        # warm-up
            sides["llamacpp_decode"] = lambda i: args.decode_tokens / runner.greedy(
                dec_prompts[i], args.decode_tokens + 1)[1]
            sides["llamacpp_prefill"] = lambda i: args.prompt_len / runner.prefill(pp_prompts[i])
        rounds: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(args.num_iters):
            for what in ("decode", "prefill"):
                order = [n for n in sides if n.endswith(what)]
                for name in (order if i % 2 == 0 else order[::-1]):
                    rounds[name].append(sides[name](i))
    finally:
        llm.shutdown()
        if runner is not None:
            runner.close()
    for name, values in rounds.items():
        entry[f"{name}_tok_s"] = max(values)
        entry[f"{name}_rounds"] = values
    if args.kvserve_only:
        return entry
    agree = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    entry["greedy_tokens_agreeing"] = agree
    entry["greedy_tokens_checked"] = args.check_tokens
    for what in ("decode", "prefill"):
        entry[f"{what}_ratio"] = float(np.median(
            [a / b for a, b in zip(rounds[f"kvserve_{what}"], rounds[f"llamacpp_{what}"])]))
    return entry


def weights_label(model: str, dtype: str) -> str:
    """The quantization type of the weights an engine runs: a GGUF file's most common 2-D
    tensor type (kvserve keeps those packed), else the dtype."""
    if not model.endswith(".gguf"):
        return dtype
    from kvserve.benchmarks.weights import matrix_types
    from kvserve.model.gguf import read_gguf_metadata
    types = matrix_types(read_gguf_metadata(model))
    return types.most_common(1)[0][0] if types else dtype


def format_report(result: dict[str, Any]) -> str:
    lines = [f"Machine: {result['machine']}", f"Model: {result['model']}", "",
             "| dtype | weights (kvserve / llama.cpp) | kvserve decode tok/s | llama.cpp decode tok/s "
             "| ratio (median of rounds) | kvserve prefill tok/s | llama.cpp prefill tok/s | ratio | "
             "greedy agreement |",
             "|---|---|---|---|---|---|---|---|---|"]
    if any("llamacpp_decode_tok_s" not in e for e in result["dtypes"].values()):
        lines[2:] = ["| dtype | weights | kvserve decode tok/s | kvserve prefill tok/s | "
                     "kvserve offline tok/s |", "|---|---|---|---|---|"]
        for dtype, e in result["dtypes"].items():
            lines.append(f"| {dtype} | {e.get('kvserve_weights', dtype)} | "
                         f"{e['kvserve_decode_tok_s']:.1f} | "
                         f"{e['kvserve_prefill_tok_s']:.0f} | {e.get('kvserve_offline_tok_s', 0):.1f} |")
        return "\n".join(lines)
    for dtype, e in result["dtypes"].items():
        lines.append(
            f"| {dtype} | {e.get('kvserve_weights', dtype)} / {e.get('llamacpp_weights', dtype)} | "
            f"{e['kvserve_decode_tok_s']:.1f} | {e['llamacpp_decode_tok_s']:.1f} | "
            f"{e['decode_ratio']:.2f}x | {e['kvserve_prefill_tok_s']:.0f} | "
            f"{e['llamacpp_prefill_tok_s']:.0f} | {e['prefill_ratio']:.2f}x | "
            f"{e['greedy_tokens_agreeing']}/{e['greedy_tokens_checked']} |"
            + (f" kvserve offline {e['kvserve_offline_tok_s']:.1f} tok/s |"
               if "kvserve_offline_tok_s" in e else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------ quantized files (issue 29)

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _llamacpp_perplexity(path: str, ids: list[int], threads: int) -> float:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + 16, n_batch=len(ids) + 16,
                          n_ubatch=len(ids) + 16, n_threads=threads, n_threads_batch=threads,
                          logits_all=True, verbose=False)
    try:
        llm.eval(ids)
        logits = np.asarray(llm.scores[:len(ids)], dtype=np.float64)
    finally:
        llm.close()
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(np.exp(-np.mean([logp[i - 1, t] for i, t in enumerate(ids) if i > 0])))


class _KvserveSide:
    """kvserve on a quantized file, in-process inside its worker (see _quant_worker)."""

    def __init__(self, path: str, opts: dict[str, Any]) -> None:
        from kvserve import LLM
        from kvserve.benchmarks.datasets import perplexity_text, prompt_perplexity
        from kvserve.benchmarks.latency import measure_prefill_throughput, random_token_prompts

        self.opts = opts
        extra = {"quantization": "gguf-dequantized"} if opts["dequantized"] else {}
        # A KV cache sized for the workload (512 MiB holds 64 offline requests of the demo),
        # not the default share of the machine's memory, so the RSS column compares engines.
        self.llm = LLM(path, max_model_len=opts["ctx"], max_num_seqs=max(1, opts["offline"]),
                       kv_cache_memory=(512 if opts["offline"] else 128) << 20,
                       enable_prefix_caching=False, multiprocessing=False,
                       dtype=opts.get("dtype", "auto"), **extra)
        ppl, ids = prompt_perplexity(self.llm, perplexity_text(1))
        measure_prefill_throughput(self.llm, opts["prompt_len"], 1)                # warm-up
        n = opts["num_iters"]
        runner = self.llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner
        self.setup = {
            "ppl": ppl, "ids": ids, "weight_bytes": runner.model.weight_bytes,
            "pp": [p["prompt_token_ids"] for p in random_token_prompts(
                self.llm, n + 1, opts["prompt_len"], seed=11)],
            "dec": [p["prompt_token_ids"] for p in random_token_prompts(
                self.llm, n, opts["decode_prompt_len"], seed=13)],
            "off": [p["prompt_token_ids"] for p in random_token_prompts(
                self.llm, opts["offline"], opts["decode_prompt_len"], seed=17)]}

    def decode(self, i: int) -> float:
        from kvserve.benchmarks.latency import measure_decode_throughput
        return measure_decode_throughput(self.llm, 1, self.opts["decode_prompt_len"],
                                         self.opts["decode_tokens"], 1,
                                         seed=1000 + 10 * i)["decode_tokens_per_second"]

    def prefill(self, i: int) -> float:
        from kvserve.benchmarks.latency import measure_prefill_throughput
        return measure_prefill_throughput(self.llm, self.opts["prompt_len"], 1,
                                          seed=2000 + 10 * i)["prefill_tokens_per_second"]

    def offline(self, i: int) -> float:
        """Generated tokens/s of all --offline-requests prompts submitted at once."""
        from kvserve import SamplingParams
        params = SamplingParams(temperature=0.0, ignore_eos=True, detokenize=False,
                                max_tokens=self.opts["decode_tokens"])
        prompts = [{"prompt_token_ids": ids} for ids in self.setup["off"]]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed

    def close(self) -> None:
        self.llm.shutdown()


class _LlamaCppSide:
    """llama.cpp on the same file and token ids, in its worker."""

    def __init__(self, path: str, opts: dict[str, Any]) -> None:
        self.opts = opts
        self.setup = {"ppl": _llamacpp_perplexity(path, opts["ids"], opts["threads"])}
        self.runner = LlamaCppRunner(path, opts["ctx"], opts["threads"])
        self.batch_runner: Optional[LlamaCppBatchRunner] = None
        self.runner.prefill(opts["pp"][-1])                                        # warm-up

    def decode(self, i: int) -> float:
        tokens = self.opts["decode_tokens"]
        return tokens / self.runner.greedy(self.opts["dec"][i], tokens + 1)[1]

    def prefill(self, i: int) -> float:
        return self.opts["prompt_len"] / self.runner.prefill(self.opts["pp"][i])

    def offline(self, i: int) -> float:
        if self.batch_runner is None:
            self.batch_runner = LlamaCppBatchRunner(self.runner.llm, len(self.opts["off"]),
                                                    self.opts["ctx"], self.opts["threads"])
        tokens = self.opts["decode_tokens"]
        return len(self.opts["off"]) * tokens / self.batch_runner.run(self.opts["off"], tokens)

    def close(self) -> None:
        if self.batch_runner is not None:
            self.batch_runner.close()
        self.runner.close()


def _quant_worker(kind: str, path: str, opts: dict[str, Any], conn: Any) -> None:
    """One engine in a process of its own: its own OpenMP runtime and spin setting (kvserve's
    as it ships, llama.cpp's default), and its own resident memory. Answers the parent's
    (method, round) calls with tokens/s until ("close", None)."""
    torch.set_num_threads(opts["threads"])
    rss0 = _rss_bytes()
    side = _KvserveSide(path, opts) if kind == "kvserve" else _LlamaCppSide(path, opts)
    conn.send({**side.setup, "rss_bytes": _rss_bytes() - rss0})
    while True:
        method, arg = conn.recv()
        if method == "close":
            side.close()
            return
        conn.send(getattr(side, method)(arg))


def _start_worker(kind: str, path: str, opts: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(process, pipe, its setup reply). llama.cpp's worker gets the environment the user ran
    this script with (kvserve's import sets GOMP_SPINCOUNT for its own processes only)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_quant_worker, args=(kind, path, opts, child), daemon=True)
    saved = {k: os.environ.get(k) for k in _USER_OMP_ENV}
    try:
        if kind == "llamacpp":
            _set_env(_USER_OMP_ENV)
        proc.start()
    finally:
        _set_env(saved)
    return proc, parent, _recv(proc, parent)


def _recv(proc: Any, conn: Any) -> Any:
    """The worker's reply; an error if it died first (its traceback is on stderr)."""
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"benchmark worker {proc.name} exited with code {proc.exitcode}")
    return conn.recv()


def _set_env(values: dict[str, Optional[str]]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def bench_quantized(path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One quantized file, each engine in its own process, taking turns round by round (the
    order alternating), so a drift of the machine lands on both."""
    import kvserve  # noqa: F401  (its GOMP_SPINCOUNT, inherited by its worker as by its engine core)

    threads = torch.get_num_threads()
    peer = "dequantized" if args.kvserve_only else "llamacpp"
    # (1024: room for the perplexity text as well)
    opts = {"ctx": max(args.prompt_len, args.decode_prompt_len + args.decode_tokens, 1024) + 32,
            "threads": threads, "prompt_len": args.prompt_len, "num_iters": args.num_iters,
            "decode_prompt_len": args.decode_prompt_len, "decode_tokens": args.decode_tokens,
            "dequantized": False, "offline": args.offline_requests, "dtype": args.kvserve_dtype}
    entry: dict[str, Any] = {"file": path, "weights": weights_label(path, "gguf"),
                             "kvserve_dtype": args.kvserve_dtype,
                             "file_bytes": os.path.getsize(path), "threads": threads,
                             "peer": peer, "gomp_spincount_kvserve": os.environ.get("GOMP_SPINCOUNT"),
                             "gomp_spincount_peer": _USER_OMP_ENV["GOMP_SPINCOUNT"]}
    workers = {}
    try:
        workers["kvserve"] = _start_worker("kvserve", path, opts)
        setup = workers["kvserve"][2]
        peer_opts = {**opts, "dequantized": True} if args.kvserve_only else {
            **opts, "ids": setup["ids"], "pp": setup["pp"], "dec": setup["dec"],
            "off": setup["off"]}
        workers[peer] = _start_worker("kvserve" if args.kvserve_only else "llamacpp", path,
                                      peer_opts)
        for name, (_, _, reply) in workers.items():
            entry.update({f"{name}_ppl": reply["ppl"], f"{name}_rss_bytes": reply["rss_bytes"]})
            if "weight_bytes" in reply:
                entry[f"{name}_weight_bytes"] = reply["weight_bytes"]
        kinds = ("decode", "prefill") + (("offline",) if args.offline_requests else ())
        rounds: dict[str, list[float]] = {f"{n}_{w}": [] for n in workers for w in kinds}
        for i in range(args.num_iters):
            for what in kinds:
                for name in (list(workers) if i % 2 else list(workers)[::-1]):
                    proc, conn, _ = workers[name]
                    conn.send((what, i))
                    rounds[f"{name}_{what}"].append(_recv(proc, conn))
    finally:
        for proc, conn, _ in workers.values():
            if proc.is_alive():
                conn.send(("close", None))
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    for name, values in rounds.items():
        entry[f"{name}_tok_s"] = max(values)
        entry[f"{name}_rounds"] = values
    for what in kinds:
        entry[f"{what}_ratio"] = float(np.median(
            [a / b for a, b in zip(rounds[f"kvserve_{what}"], rounds[f"{peer}_{what}"])]))
    entry["offline_requests"] = args.offline_requests
    return entry


def format_quantized(result: dict[str, Any]) -> str:
    peer = next(iter(result["files"].values()))["peer"] if result["files"] else "llamacpp"
    name = "llama.cpp" if peer == "llamacpp" else "kvserve dequantized f32"
    lines = [f"Machine: {result['machine']}", f"Load average at start: {result['loadavg']}", "",
             f"| file (type) | MB | decode tok/s (best round) kvserve / {name} | ratio (median of "
             f"paired rounds) | prompt {result['prompt_len']} tok/s kvserve / {name} | ratio | kvserve weights MB | RSS MB kvserve / {name} | "
             f"perplexity kvserve / {name} |", "|---|---|---|---|---|---|---|---|---|"]
    for path, e in result["files"].items():
        mb = 2 ** 20
        lines.append(
            f"| {os.path.basename(path)} ({e['weights']}) | {e['file_bytes'] / mb:.0f} | "
            f"{e['kvserve_decode_tok_s']:.1f} / {e[peer + '_decode_tok_s']:.1f} | "
            f"{e['decode_ratio']:.2f}x | {e['kvserve_prefill_tok_s']:.0f} / "
            f"{e[peer + '_prefill_tok_s']:.0f} | {e['prefill_ratio']:.2f}x | "
            f"{e['kvserve_weight_bytes'] / mb:.1f} | "
            f"{e['kvserve_rss_bytes'] / mb:.0f} / {e[peer + '_rss_bytes'] / mb:.0f} | "
            f"{e['kvserve_ppl']:.3f} / {e[peer + '_ppl']:.3f} |")
    offline = [(p, e) for p, e in result["files"].items() if e.get("offline_requests")]
    if offline:
        lines += ["", f"| file | offline, {offline[0][1]['offline_requests']} requests: generated "
                      f"tok/s kvserve / {name} | ratio |", "|---|---|---|"]
        lines += [f"| {os.path.basename(p)} | {e['kvserve_offline_tok_s']:.1f} / "
                  f"{e[peer + '_offline_tok_s']:.1f} | {e['offline_ratio']:.2f}x |"
                  for p, e in offline]
    return "\n".join(lines)


def main_quantized(args: argparse.Namespace) -> int:
    from kvserve.model.demo import fetch_demo_gguf

    result: dict[str, Any] = {"machine": machine_description(), "prompt_len": args.prompt_len,
                              "loadavg": " ".join(open("/proc/loadavg").read().split()[:3]),
                              "files": {}}
    for f in args.quantized_files:
        path = os.path.abspath(fetch_demo_gguf() if f == "demo" else f)
        result["files"][path] = bench_quantized(path, args)
        # Each file's row as soon as it is measured (a long run on a loaded machine).
        print(format_quantized({**result, "files": {path: result["files"][path]}}).splitlines()[-1],
              flush=True)
    print(format_quantized(result))
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="Checkpoint directory, a .gguf file (dequantized once to float32 for the "
                        "llama.cpp side; kvserve loads the file itself) or 'demo' (the demo GGUF). "
                        "Default: the ~110M Llama.")
    p.add_argument("--model-dir", default=DEFAULT_MODEL_DIR,
                   help="Where the default model and the GGUF files are kept.")
    p.add_argument("--gguf-dir", default=None, help="Where to write GGUF files (default: --model-dir).")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(GGUF_TYPES))
    p.add_argument("--prompt-len", type=int, default=512, help="Prompt processing: prompt tokens.")
    p.add_argument("--decode-prompt-len", type=int, default=32, help="Decode: prompt before it.")
    p.add_argument("--decode-tokens", type=int, default=128, help="Decode: steps timed.")
    p.add_argument("--check-tokens", type=int, default=16, help="Greedy tokens compared.")
    p.add_argument("--num-iters", type=int, default=3,
                   help="Rounds; in each, the two engines take turns (the order alternates).")
    p.add_argument("--offline-requests", type=int, default=0,
                   help="Also measure offline throughput on this many requests (kvserve alone; with "
                        "--quantized-files against llama.cpp decoding them as parallel sequences, "
                        "as llama-server's slots do).")
    p.add_argument("--kvserve-only", action="store_true",
                   help="Measure kvserve only (no llama-cpp-python needed).")
    p.add_argument("--export-only", action="store_true",
                   help="Write and verify the GGUF files; no llama-cpp-python needed.")
    p.add_argument("--quantized-files", nargs="+", default=None,
                   help="Quantized GGUF files ('demo': the demo's Q4_1): both engines on each "
                        "file itself (kvserve keeping it packed); see the module doc.")
    p.add_argument("--kvserve-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="--quantized-files: kvserve's activation dtype (bfloat16: prompt GEMMs "
                        "in bf16).")
    p.add_argument("--output-json", default=None)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    if _missing("gguf"):
        print(INSTALL_HINT.format(what="The gguf package (GGUF export)", pkg="gguf",
                                  extra=""))
        return 0
    if not (args.export_only or args.kvserve_only) and _missing("llama_cpp"):
        print(INSTALL_HINT.format(
            what="llama-cpp-python", pkg="llama-cpp-python",
            extra="(it compiles llama.cpp from source: about 6 minutes on 2 cores), "))
        return 0
    if args.quantized_files:
        return main_quantized(args)
    model = args.model or ensure_bench_model(args.model_dir)
    kvserve_model = model
    if model == "demo" or model.endswith(".gguf"):
        from gguf_load import dequantize_to_checkpoint

        from kvserve.model.demo import fetch_demo_gguf
        kvserve_model = os.path.abspath(fetch_demo_gguf() if model == "demo" else model)
        model = dequantize_to_checkpoint(kvserve_model, os.path.join(
            args.model_dir, os.path.basename(kvserve_model)[:-len(".gguf")] + "-f32"))
    gguf_dir = args.gguf_dir or args.model_dir
    os.makedirs(gguf_dir, exist_ok=True)
    result: dict[str, Any] = {"machine": machine_description(), "model": kvserve_model,
                              "dtypes": {}}
    for dtype in args.dtypes:
        path = os.path.join(gguf_dir, f"{os.path.basename(os.path.normpath(model))}-{GGUF_TYPES[dtype].lower()}.gguf")
        if not os.path.isfile(path) or os.path.getmtime(path) < os.path.getmtime(
                os.path.join(model, "config.json")):
            export_gguf(model, path, dtype)
        if args.export_only:
            n = check_gguf(path, model, dtype)
            print(f"{path}: {n} tensors equal to the checkpoint's ({dtype})")
            continue
        result["dtypes"][dtype] = bench_dtype(kvserve_model, dtype, path, args)
        print(f"[{dtype}] done", flush=True)
    if not args.export_only:
        print(format_report(result))
        if args.output_json:
            write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
