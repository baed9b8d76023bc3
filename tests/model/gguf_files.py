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
    """Add `t` to a GGUFWriter as F32, F16 or a block type quantized by gguf's quantizers."""
    import gguf
    from gguf.quants import quantize

    data = t.float().numpy()
    if qtype in ("F32", "F16"):
        writer.add_tensor(name, data.astype(np.float16 if qtype == "F16" else np.float32))
    else:
        q = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, quantize(data, q), raw_dtype=q)


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
