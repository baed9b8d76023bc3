"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

A GGUF file carries the model's hyper-parameters and tokenizer as metadata and its tensors
under llama.cpp's names, possibly block-quantized. Here it becomes what the rest of kvserve
already understands: an HF-style config dict (`gguf_hf_config`) and a stream of HF-named
float32 tensors (`iterate_gguf_weights`), dequantized one tensor at a time, so that loading
peaks at about one model in the run dtype plus one float32 tensor. The tokenizer lives in
`gguf_tokenizer.py`.

llama.cpp's converter reorders the rows of q_proj / k_proj for the "llama" architecture
(Hugging Face's rotary layout rotates the two halves of a head, llama.cpp's adjacent pairs);
loading undoes that. Qwen2 / Qwen3 files are stored in Hugging Face's layout already.

Mixture-of-experts files (Mixtral: "llama" with `expert_count`; Qwen3-MoE: "qwen3moe") hold
each layer's experts stacked, as llama.cpp's converter writes them: ffn_gate_exps /
ffn_up_exps [E, I, H], ffn_down_exps [E, H, I], and the router ffn_gate_inp [E, H]. They are
yielded one expert at a time under the checkpoint's per-expert names (so FusedMoE's loader and
expert parallelism's skip list apply unchanged; a skipped expert's blocks are never read).
With `packed`, a layer's expert stacks of types ops.quant packs come as each expert's raw
blocks (QuantizedRows, file views), which FusedMoE keeps packed (layers/fused_moe/packed.py);
gate and up only together (FusedMoE fuses them), so a layer whose gate or up is of another type
has both dequantized. Other stacks (F16 / BF16 / F32) are dequantized as before.
"""
from __future__ import annotations

import logging
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from kvserve.config import is_gguf

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> (HF `architectures` entry, `model_type`). Mistral files say
# "llama": llama.cpp converts them as Llama, and they are the same network here.
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# A "llama" file with experts (expert_count > 0) is Mixtral's.
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED_ARCHITECTURES = {"llama"}

# Tensor types kvserve loads. With --quantization gguf (a .gguf path's default) the packed
# types (ops.quant.PACKED_TYPES, Q2_K, Q3_K and IQ4_NL among them) stay packed, IQ4_XS is
# rewritten as packed IQ4_NL (ops/quant/transcode.py), and the rest (the IQ1-IQ3
# types) are dequantized (`gguf.quants.dequantize`), as every type is with
# --quantization gguf-dequantized.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                          "Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "Q2_K", "IQ4_XS", "IQ3_S", "IQ3_XXS",
                          "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")

# llama.cpp tensor name -> HF name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",           # the MoE router
}
# Stacked experts [E, ...] -> FusedMoE's shard ("w1" gate, "w3" up, "w2" down), and each
# family's per-expert checkpoint name of that shard (MoEForCausalLM.expert_projections).
_EXPERT_TENSORS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
_EXPERT_PROJECTIONS = {
    "mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"},
    "qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def expert_tensor(gguf_name: str) -> Optional[tuple[int, str]]:
    """(layer, "w1" | "w3" | "w2") for a stacked-experts tensor's name, else None."""
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(3) == "weight" and m.group(2) in _EXPERT_TENSORS:
        return int(m.group(1)), _EXPERT_TENSORS[m.group(2)]
    return None


def hf_expert_name(layer: int, expert: int, shard: str, model_type: str) -> str:
    """The checkpoint name of one expert's matrix (Mixtral's block_sparse_moe is our mlp)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_PROJECTIONS[model_type][shard]}" \
           f".weight"


def hf_tensor_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of a llama.cpp tensor name (None when it has none; stacked
    experts: `expert_tensor`)."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        hf = _LAYER_NAMES.get(part)
        return None if hf is None else f"model.layers.{layer}.{hf}.{kind}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in the file, as the reader found it."""
    name: str
    type_name: str                 # GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]         # PyTorch order (GGUF lists dimensions innermost first)
    data_offset: int               # byte offset of its data in the file
    data_shape: tuple[int, ...]    # the reader's view of the data: rows x bytes for quantized types
    data_dtype: str                # that view's numpy dtype


@dataclass(frozen=True)
class GGUFMetadata:
    """Everything but the tensor data: metadata values and tensor descriptions."""
    path: str
    fields: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """An architecture key without its prefix: get("block_count") -> llama.block_count."""
        return self.fields.get(f"{self.architecture}.{key}", default)


def open_reader(path: str) -> Any:
    """A `gguf.GGUFReader` on `path`; a file that is not GGUF, or truncated, is a ValueError."""
    import gguf

    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist.")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:     # the reader raises whatever its parsing ran into
        raise ValueError(f"{path!r} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(e).__name__}: {e}") from None
    for t in reader.tensors:   # a file cut inside the tensor data still parses its header
        if t.data.nbytes != int(t.n_bytes):
            raise ValueError(f"GGUF file {path!r} is truncated: tensor {t.name!r} has "
                             f"{t.data.nbytes} of its {int(t.n_bytes)} bytes.")
    return reader


def read_gguf_metadata(path: str) -> GGUFMetadata:
    """The file's metadata. The reader takes several seconds to parse a 49k-token vocabulary,
    so the result is kept per process and, as JSON, in kvserve's cache directory (keyed by the
    file's path, size and modification time) for the next process."""
    path = os.path.abspath(path)
    try:
        st = os.stat(path)
    except OSError:
        raise ValueError(f"GGUF file {path!r} does not exist.") from None
    return _read_gguf_metadata(path, st.st_size, st.st_mtime_ns)


_METADATA_CACHE_VERSION = 1


@lru_cache(maxsize=4)
def _read_gguf_metadata(path: str, size: int, mtime_ns: int) -> GGUFMetadata:
    import hashlib
    import json

    from kvserve.envs import cache_dir

    key = hashlib.sha256(f"{_METADATA_CACHE_VERSION}|{path}|{size}|{mtime_ns}".encode()).hexdigest()
    cached = os.path.join(cache_dir(), "gguf-metadata", key[:24] + ".json")
    if os.path.isfile(cached):
        with open(cached, encoding="utf-8") as f:
            data = json.load(f)
        tensors = tuple(GGUFTensorInfo(t[0], t[1], tuple(t[2]), t[3], tuple(t[4]), t[5])
                        for t in data["tensors"])
        return GGUFMetadata(path, data["fields"], tensors)
    meta = _parse_gguf_metadata(path)
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = f"{cached}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"fields": meta.fields, "tensors": [
                [t.name, t.type_name, t.shape, t.data_offset, t.data_shape, t.data_dtype]
                for t in meta.tensors]}, f, default=lambda o: o.tolist())  # numpy scalars, arrays
        os.replace(tmp, cached)
    except OSError:
        pass          # a read-only cache directory only costs the next process the parse
    return meta


def _parse_gguf_metadata(path: str) -> GGUFMetadata:
    reader = open_reader(path)
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            fields[name] = field.contents()
        except Exception as e:
            raise ValueError(f"GGUF file {path!r}: cannot read metadata {name!r}: {e}") from None
    tensors = tuple(GGUFTensorInfo(t.name, t.tensor_type.name,
                                   tuple(int(d) for d in reversed(t.shape)), int(t.data_offset),
                                   tuple(int(d) for d in t.data.shape), t.data.dtype.str)
                    for t in reader.tensors)
    return GGUFMetadata(path, fields, tensors)


def check_gguf_supported(meta: GGUFMetadata, use_hf_config: bool = False) -> None:
    """Raise a ValueError naming what kvserve cannot load: architecture, tensor types,
    tensors with no counterpart in the model."""
    arch = meta.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} ({meta.path}) is not supported. Supported "
                         f"GGUF architectures: {', '.join(sorted(GGUF_ARCHITECTURES))} "
                         f"(Mistral files use 'llama').")
    bad_types = sorted({t.type_name for t in meta.tensors} - set(SUPPORTED_TENSOR_TYPES))
    if bad_types:
        names = [t.name for t in meta.tensors if t.type_name in bad_types][:3]
        raise ValueError(f"GGUF tensor type(s) {', '.join(bad_types)} in {meta.path} (e.g. "
                         f"{', '.join(names)}) are not supported. Supported types: "
                         f"{', '.join(SUPPORTED_TENSOR_TYPES)}.")
    for t in meta.tensors:
        if t.name == "rope_freqs.weight":
            if use_hf_config:
                continue     # the HF config states the rope scaling these factors encode
            raise ValueError(f"GGUF file {meta.path} has per-frequency rope factors "
                             f"(rope_freqs.weight, Llama 3.1-style rope scaling) that its metadata "
                             f"does not describe: pass --hf-config-path with the model's "
                             f"config.json.")
        if hf_tensor_name(t.name) is None and expert_tensor(t.name) is None:
            raise ValueError(f"GGUF tensor {t.name!r} in {meta.path} has no counterpart in "
                             f"kvserve's {arch} model.")


def read_gguf_config(path: str, load_format: str = "auto",
                     hf_config_path: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The HF-style config of a GGUF `path`, as plain data for ModelConfig.from_path /
    load_hf_config (`gguf_config`). None when `path` is not GGUF, or when `hf_config_path`
    supplies the config (the file is still checked as loadable)."""
    if not is_gguf(path, load_format):
        return None
    if not os.path.isfile(path):
        raise ValueError(f"GGUF model {path!r} is not a file.")
    meta = read_gguf_metadata(path)
    check_gguf_supported(meta, use_hf_config=hf_config_path is not None)
    return None if hf_config_path else gguf_hf_config(meta)


def _rope_scaling(meta: GGUFMetadata) -> Optional[dict]:
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    raise ValueError(f"GGUF file {meta.path}: rope scaling type {kind!r} is not supported; pass "
                     f"--hf-config-path with a config.json whose rope_scaling kvserve supports.")


_FLOAT_TYPES = ("F32", "F16", "BF16")


def _torch_dtype_name(meta: GGUFMetadata) -> str:
    """The file's float type; float32 for quantized files, which are dequantized exactly into
    it (on a CPU with bf16 math, config.resolve_dtype runs packed files in bfloat16)."""
    types = {t.type_name for t in meta.tensors if len(t.shape) > 1}
    if types == {"BF16"}:
        return "bfloat16"
    if types == {"F16"}:
        return "float16"
    return "float32"


def gguf_hf_config(meta: GGUFMetadata) -> dict[str, Any]:
    """An HF-style config.json dict from the GGUF metadata."""
    check_gguf_supported(meta)
    architecture, model_type = GGUF_ARCHITECTURES[meta.architecture]
    if meta.architecture == "llama" and meta.get("expert_count"):
        architecture, model_type = _MIXTRAL
    names = {t.name for t in meta.tensors}
    n_heads = int(meta.get("attention.head_count"))
    hidden = int(meta.get("embedding_length"))
    vocab = meta.get("vocab_size") or len(meta.fields.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        embd = next((t for t in meta.tensors if t.name == "token_embd.weight"), None)
        vocab = embd.shape[0] if embd else 0
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.get("feed_forward_length")
                                 or meta.get("expert_feed_forward_length") or 0),
        "num_hidden_layers": int(meta.get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv") or n_heads),
        "head_dim": int(meta.get("attention.key_length") or hidden // n_heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get("context_length") or 2048),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(meta.get("rope.freq_base") or 10000.0),
        "rope_scaling": _rope_scaling(meta),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": _torch_dtype_name(meta),
        # Block-quantized matrices (Q4_0 ... Q6_K): config.resolve_dtype's bf16 rule on CPU.
        "gguf_block_quantized": any(len(t.shape) > 1 and t.type_name not in _FLOAT_TYPES
                                    for t in meta.tensors),
    }
    if model_type in _EXPERT_PROJECTIONS:
        config.update(_moe_config(meta, model_type, config["intermediate_size"]))
    check_gguf_shapes(meta, config)
    if model_type in ("llama", "mixtral"):
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    else:
        config["use_sliding_window"] = False
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.fields.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def _moe_config(meta: GGUFMetadata, model_type: str, intermediate_size: int) -> dict[str, Any]:
    """The MoE keys of the HF config (llama.cpp's expert_count / expert_used_count /
    expert_feed_forward_length). llama.cpp renormalises the top-k weights of both families
    (Qwen3-MoE's norm_topk_prob) unless expert_weights_norm says otherwise."""
    experts, used = int(meta.get("expert_count") or 0), int(meta.get("expert_used_count") or 0)
    if not 0 < used <= experts:
        raise ValueError(f"GGUF file {meta.path} is inconsistent: expert_used_count {used} must be "
                         f"in [1, expert_count={experts}].")
    if model_type == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    return {"num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": int(meta.get("expert_feed_forward_length")
                                         or intermediate_size),
            "norm_topk_prob": bool(meta.get("expert_weights_norm", True)),
            "decoder_sparse_step": 1, "mlp_only_layers": []}


def _expected_moe_shapes(config: dict[str, Any], num_layers: int
                         ) -> dict[str, tuple[int, ...]]:
    """Every layer's router and stacked experts, as the config says they are."""
    experts = config.get("num_local_experts") or config["num_experts"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    hidden = config["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(num_layers):
        shapes.update({f"blk.{i}.ffn_gate_inp.weight": (experts, hidden),
                       f"blk.{i}.ffn_gate_exps.weight": (experts, inter, hidden),
                       f"blk.{i}.ffn_up_exps.weight": (experts, inter, hidden),
                       f"blk.{i}.ffn_down_exps.weight": (experts, hidden, inter)})
    return shapes


def check_gguf_shapes(meta: GGUFMetadata, config: dict[str, Any]) -> None:
    """The hyper-parameters the metadata states agree with the tensors the file holds, so
    that an absurd value (a corrupt or hostile file) is a clear error here instead of a huge
    allocation when the model is built."""
    def bad(why: str) -> ValueError:
        return ValueError(f"GGUF file {meta.path} is inconsistent: {why}.")

    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        if not config[key] > 0:
            raise bad(f"{key} is {config[key]}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise bad(f"{config['num_attention_heads']} attention heads are not a multiple of "
                  f"{config['num_key_value_heads']} KV heads")
    shapes = {t.name: t.shape for t in meta.tensors}
    layers = {int(m.group(1)) for m in map(_LAYER_RE.match, shapes) if m}
    if layers != set(range(config["num_hidden_layers"])):
        raise bad(f"block_count is {config['num_hidden_layers']} but the file has tensors for "
                  f"{len(layers)} layers")
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    expected = {
        "token_embd.weight": (config["vocab_size"], hidden),
        "blk.0.attn_q.weight": (config["num_attention_heads"] * head_dim, hidden),
        "blk.0.attn_k.weight": (config["num_key_value_heads"] * head_dim, hidden),
    }
    if config["model_type"] in _EXPERT_PROJECTIONS:
        expected.update(_expected_moe_shapes(config, config["num_hidden_layers"]))
    else:
        expected["blk.0.ffn_up.weight"] = (config["intermediate_size"], hidden)
    for name, shape in expected.items():
        if name not in shapes:
            raise bad(f"tensor {name} is missing")
        # The vocabulary may be padded past the tokenizer's tokens (rows >= the stated size).
        if name == "token_embd.weight" and shapes[name][1:] == shape[1:] \
                and shapes[name][0] >= shape[0]:
            continue
        if tuple(shapes[name]) != shape:
            raise bad(f"tensor {name} has shape {tuple(shapes[name])}, the metadata says {shape}")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its converter's `LlamaModel.permute`): within each
    head, rows stored as interleaved pairs go back to Hugging Face's two halves."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def iterate_gguf_weights(path: str, hf_config: dict, packed: bool = False,
                         skip: Optional[Callable[[str], bool]] = None
                         ) -> Iterator[tuple[str, Any]]:
    """Yield (HF name, float32 tensor) for every tensor of the file, dequantized one at a time
    (the caller copies each into its parameter before the next is made). `packed`: 2-D
    tensors of a type ops.quant packs come as ops.quant.QuantizedRows (their raw blocks, a
    view of the file; kept packed by the layers) instead. The data is read through a memory
    map at the offsets the reader found (see `read_gguf_metadata`). Stacked experts come one
    expert at a time, dequantized or (`packed`, see the module doc) as raw blocks; the names
    `skip` gives (other expert-parallel ranks' experts) are not read. Logs in one line what
    stays packed and what does not."""
    import gguf
    from gguf.quants import dequantize

    from kvserve.ops.quant import KEPT_TYPES
    from kvserve.ops.quant.weight import QuantizedRows

    meta = read_gguf_metadata(path)
    permuted = meta.architecture in _PERMUTED_ARCHITECTURES
    n_head = int(hf_config["num_attention_heads"])
    n_kv = int(hf_config.get("num_key_value_heads") or n_head)
    mapped = np.memmap(meta.path, mode="r")
    kept: Counter = Counter()
    floats: Counter = Counter()
    packed_experts = _packed_expert_tensors(meta.tensors) if packed else set()
    for t in meta.tensors:
        name = hf_tensor_name(t.name)
        dtype = np.dtype(t.data_dtype)
        nbytes = int(np.prod(t.data_shape)) * dtype.itemsize
        raw = mapped[t.data_offset:t.data_offset + nbytes].view(dtype).reshape(t.data_shape)
        if expert_tensor(t.name) is not None:
            keep = t.name in packed_experts
            yield from _expert_weights(t, raw, hf_config, skip, keep)
            (kept if keep else floats)[_packed_name(t.type_name) if keep else t.type_name] += 1
            continue
        if name is None or (skip is not None and skip(name)):
            continue                 # rope_freqs: check_gguf_supported allowed it (HF config)
        keep = packed and t.type_name in KEPT_TYPES and len(t.shape) == 2
        (kept if keep else floats)[_packed_name(t.type_name) if keep else t.type_name] += 1
        if keep:
            data = raw.view(np.uint8).reshape(t.shape[0], -1)   # rows of blocks
        else:
            data = dequantize(raw, gguf.GGMLQuantizationType[t.type_name])
            if data.dtype != np.float32 or not data.flags.writeable:   # F32 / F16: file views
                data = data.astype(np.float32)
            data = torch.from_numpy(data.reshape(t.shape))
        # The permutation moves whole rows: the same on raw blocks (numpy) as on floats.
        if permuted and ".q_proj." in name:
            data = unpermute_qk(data, n_head)
        elif permuted and ".k_proj." in name:
            data = unpermute_qk(data, n_kv)
        yield name, (QuantizedRows.from_file(t.type_name, data, t.shape) if keep else data)
    del mapped
    _log_packing(meta.path, kept, floats)


def _packed_name(qtype: str) -> str:
    """How the load log names a packed type: "IQ4_XS as IQ4_NL" where it is rewritten."""
    from kvserve.ops.quant import TRANSCODED

    return f"{qtype} as {TRANSCODED[qtype]}" if qtype in TRANSCODED else qtype


def _packed_expert_tensors(tensors: list[GGUFTensorInfo]) -> set[str]:
    """The stacked-experts tensors kept packed: of a type ops.quant keeps packed (KEPT_TYPES),
    gate and up of a layer only when both are (the module doc)."""
    from kvserve.ops.quant import KEPT_TYPES

    packable = {t.name for t in tensors
                if expert_tensor(t.name) is not None and t.type_name in KEPT_TYPES}
    keep = set()
    for name in packable:
        layer, shard = expert_tensor(name)
        if shard == "w2" or {f"blk.{layer}.ffn_gate_exps.weight",
                             f"blk.{layer}.ffn_up_exps.weight"} <= packable:
            keep.add(name)
    return keep


def _expert_weights(t: GGUFTensorInfo, raw: np.ndarray, hf_config: dict,
                    skip: Optional[Callable[[str], bool]], keep: bool = False
                    ) -> Iterator[tuple[str, Any]]:
    """One stacked-experts tensor as (per-expert HF name, float32 [rows, cols]) pairs: the
    expert's rows of blocks are a contiguous slice of the tensor, dequantized alone; `keep`:
    as QuantizedRows, the expert's raw blocks (a view of the file), unread here."""
    import gguf
    from gguf.quants import dequantize

    from kvserve.ops.quant.weight import QuantizedRows

    layer, shard = expert_tensor(t.name)
    qtype = gguf.GGMLQuantizationType[t.type_name]
    for expert in range(t.shape[0]):
        name = hf_expert_name(layer, expert, shard, hf_config["model_type"])
        if skip is not None and skip(name):
            continue
        if keep:
            rows = raw[expert].view(np.uint8).reshape(t.shape[1], -1)     # rows of blocks
            yield name, QuantizedRows.from_file(t.type_name, rows, t.shape[1:])
            continue
        data = np.array(dequantize(raw[expert], qtype), dtype=np.float32)   # a copy: the
        yield name, torch.from_numpy(data.reshape(t.shape[1:]))             # map is read-only


def _log_packing(path: str, kept: Counter, floats: Counter) -> None:
    def counts(c: Counter) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none"

    logger.info("GGUF %s: %d tensors stay packed (%s); %d loaded as float (%s).",
                os.path.basename(path), sum(kept.values()), counts(kept), sum(floats.values()),
                counts(floats))
