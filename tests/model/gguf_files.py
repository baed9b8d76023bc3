"""Writing small GGUF files for the tests, with the `gguf` package's writer and its own
tensor-name map (so the loader's name table is checked against llama.cpp's, not itself)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import numpy as np
import torch
from safetensors.torch import load_file

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter (LlamaModel.permute): halves -> interleaved pairs, per head."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def roundtrip(t: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a tensor stored as `qtype` reads back as (float32)."""
    import gguf
    from gguf.quants import dequantize, quantize

    if t.dim() < 2 or qtype == "F32":
        return t.float()
    q = gguf.GGMLQuantizationType[qtype]
    return torch.from_numpy(np.array(dequantize(quantize(t.float().numpy(), q), q),
                                     dtype=np.float32)).reshape(t.shape)


def quantize_blocks(w: np.ndarray, qtype: str) -> np.ndarray:
    """[..., K] float32 -> [..., row_bytes] uint8 blocks of `qtype`: gguf's quantizers, and for
    IQ4_NL and Q3_K (which gguf only dequantizes) plain round-to-nearest ones written here
    for test files. Their blocks are read back by gguf.quants.dequantize; llama.cpp's own
    quantizer (search, imatrix) makes better ones, which the llama.cpp tests use."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == "IQ4_NL":
        return _iq4_nl_blocks(w.reshape(-1, 32)).reshape(*w.shape[:-1], -1)
    if qtype == "Q3_K":
        return _q3_k_blocks(w.reshape(-1, 256)).reshape(*w.shape[:-1], -1)
    return quantize(w, GGMLQuantizationType[qtype])


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def _iq4_nl_blocks(x: np.ndarray) -> np.ndarray:
    from kvserve.ops.quant.formats import IQ4_NL_VALUES

    table = IQ4_NL_VALUES.astype(np.float32)
    d = _f16(np.abs(x).max(axis=1) / 127.0)
    scaled = x / np.where(d == 0, 1, d.astype(np.float32))[:, None]
    q = np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8)    # [n, 32]
    return np.concatenate([d[:, None].view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _q3_k_blocks(x: np.ndarray) -> np.ndarray:
    """Q3_K: per 16 weights a 6-bit signed scale (of the block's float16 d), q in -4..3."""
    n = x.shape[0]
    g = x.reshape(n, 16, 16)
    amax = np.abs(g).max(axis=2)
    sign = np.where(np.take_along_axis(g, np.abs(g).argmax(axis=2)[..., None], 2)[..., 0] < 0,
                    1.0, -1.0)
    scale = sign * amax / 4.0                    # the largest |w| of a group lands on q = -4
    d = _f16(np.abs(scale).max(axis=1) / 32.0)
    d32 = np.where(d == 0, 1, d.astype(np.float32))[:, None]
    sc = np.clip(np.rint(scale / d32), -32, 31)
    step = (d32 * sc)[..., None]
    q = np.clip(np.rint(g / np.where(step == 0, 1, step)), -4, 3).astype(np.int16) + 4
    q = q.reshape(n, 256).astype(np.uint8)                 # 0..7: value e = 128 h + 32 s + l
    qs = (q.reshape(n, 2, 4, 32) & 3) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    hm = (q.reshape(n, 8, 32) >> 2) << np.arange(8, dtype=np.uint8)[None, :, None]
    s = (sc + 32).astype(np.uint8)                          # [n, 16]
    scales = np.concatenate([(s[:, :8] & 15) | ((s[:, 8:] & 15) << 4),
                             ((s >> 4).reshape(n, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[
                                 None, :, None]).sum(axis=1, dtype=np.uint8)], axis=1)
    return np.concatenate([hm.sum(axis=1, dtype=np.uint8), qs.sum(axis=2, dtype=np.uint8)
                           .reshape(n, 64), scales, d[:, None].view(np.uint8)], axis=1)


def _add_tokenizer(writer, ckpt: str, pre: str) -> None:
    import gguf

    with open(os.path.join(ckpt, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    with open(os.path.join(ckpt, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    n = max([*by_id, *special]) + 1
    tokens = [special.get(i, by_id.get(i, f"[PAD{i}]")) for i in range(n)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(n)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in tok["model"]["merges"]])
    writer.add_bos_token_id(tokens.index(tok_cfg["bos_token"]))
    writer.add_eos_token_id(tokens.index(tok_cfg["eos_token"]))
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    writer.add_chat_template(tok_cfg["chat_template"])


def store_tensor(writer, name: str, t: torch.Tensor, qtype: str) -> None:
    """Add `t` to a GGUFWriter as F32, F16 or a block type (quantize_blocks)."""
    import gguf

    data = t.float().numpy()
    if qtype in ("F32", "F16"):
        writer.add_tensor(name, data.astype(np.float16 if qtype == "F16" else np.float32))
    else:
        q = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, quantize_blocks(data, qtype), raw_dtype=q)


def add_model_header(w: Any, cfg: dict, n_kv: int, head_dim: int, rope_theta: float) -> None:
    """The model keys llama.cpp's converter writes from config.json (shared with MoE files)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])


def write_gguf(ckpt: str, out: str, qtype: str = "F32", *, arch: Optional[str] = None,
               permute: Optional[bool] = None, pre: str = "default",
               tensor_types: Optional[dict[str, str]] = None) -> str:
    """The checkpoint `ckpt` (HF layout) as a GGUF file as llama.cpp's converter writes it:
    2-D tensors stored as `qtype` (or `tensor_types[hf_name]`), norms as F32, q/k rows
    permuted for the "llama" architecture. `arch` overrides general.architecture."""
    import gguf

    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    real_arch = GGUF_ARCH[cfg["architectures"][0]]
    arch = arch or real_arch
    permute = (real_arch == "llama") if permute is None else permute
    n_layers, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_head
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w = gguf.GGUFWriter(out, arch)
    add_model_header(w, cfg, n_kv, head_dim, float(cfg.get("rope_theta", 10000.0)))
    _add_tokenizer(w, ckpt, pre)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[real_arch.upper()], n_layers)
    for name, t in load_file(os.path.join(ckpt, "model.safetensors")).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        if permute and "q_proj" in name:
            t = llamacpp_permute(t, n_head)
        elif permute and "k_proj" in name:
            t = llamacpp_permute(t, n_kv)
        store_tensor(w, gguf_name, t, (tensor_types or {}).get(name, qtype) if t.dim() == 2
                     else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
