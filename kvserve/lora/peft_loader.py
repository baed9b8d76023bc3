"""Read and check a PEFT LoRA adapter: adapter_config.json + adapter_model.safetensors.

Tensor names are PEFT's: `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`
with A [r, in_features] and B [out_features, r]. The delta of a module is
`scaling * x @ A^T @ B^T`, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)); r is the
module's own rank (A's rows), which covers PEFT's `rank_pattern`.

Outside the decoder layers (kept under layer index -1): `lm_head` (a linear: A [r, hidden],
B [vocab, r]) and `embed_tokens`, which PEFT saves as `lora_embedding_A` [r, vocab] (a lookup
table, read transposed) and `lora_embedding_B` [hidden, r]; its delta is
`scaling * A^T[ids] @ B^T`.

`check_adapter` reads only the config and the safetensors header (cheap: the input processor
calls it at add time, so a bad adapter is a 400 before anything is scheduled); `load_adapter`
also reads the tensors and folds the scaling into B.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvserve.lora.config import LoRAConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The modules kvserve puts LoRA on: the linears of every supported decoder layer, the token
# embedding and the LM head.
LAYER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = LAYER_MODULES + ("embed_tokens", "lm_head")
# The layer index under which embed_tokens and lm_head are kept.
OUTSIDE_LAYERS = -1
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_TOP_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(embed_tokens|lm_head)\."
                      r"lora_(?:embedding_)?([AB])(?:\.\w+)?(?:\.weight)?$")

# PEFT also saves the base embedding / LM head weights of an adapter that targets them
# (save_embedding_layers): frozen copies of the base model's, so kvserve keeps its own and
# only checks their shape (a resized vocabulary is an error).
_BASE_COPY_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(embed_tokens|lm_head)\."
                            r"base_layer\.weight$")


def _parse_key(key: str) -> Optional[tuple[int, str, str]]:
    """(layer, module, "A" | "B") of a LoRA tensor name, None if it is not one."""
    m = _KEY.match(key)
    if m is not None:
        return int(m.group(1)), m.group(2), m.group(3)
    m = _TOP_KEY.match(key)
    if m is not None:
        return OUTSIDE_LAYERS, m.group(1), m.group(2)
    return None


@dataclass
class LoRAModel:
    """One adapter's weights, full (unsharded) and on CPU: (layer, module) -> (A, scaled B)."""
    lora_int_id: int
    lora_name: str
    rank: int                                   # the largest module rank
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(hf_config: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each supported module, from the base model's config."""
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    vocab = int(hf_config["vocab_size"])
    # embed_tokens: PEFT's lora_embedding_A is [r, vocab] and lora_embedding_B [hidden, r],
    # the shapes of a linear vocab -> hidden.
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
            "embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab)}


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory.")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}.")
    with open(cfg_path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON ({e}).") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA.")
    unsupported = {"use_dora": False, "bias": "none", "alpha_pattern": {}, "modules_to_save": None,
                   "trainable_token_indices": None, "lora_bias": False}
    for key, ok in unsupported.items():
        if cfg.get(key) not in (ok, None) and cfg.get(key) != ok:
            raise ValueError(f"LoRA adapter {path!r}: {key}={cfg.get(key)!r} is not supported "
                             f"by kvserve.")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(SUPPORTED_MODULES))
        if unknown:
            raise ValueError(f"LoRA adapter {path!r} targets {unknown}, which kvserve does not "
                             f"support; supported target modules: {', '.join(SUPPORTED_MODULES)}.")
    return cfg


def _scaling(cfg: dict[str, Any], rank: int) -> float:
    alpha = float(cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def check_adapter(path: str, lora_config: LoRAConfig, hf_config: dict
                  ) -> dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]]:
    """Check the adapter against the base model and the limits, reading no tensor data.
    Returns (layer, module) -> (A's shape, B's shape). Raises ValueError naming the problem."""
    cfg = _read_config(path)
    weights_path = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}.")
    from safetensors import safe_open
    try:
        with safe_open(weights_path, framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:   # safetensors raises its own error types for a bad header
        raise ValueError(f"LoRA adapter {path!r}: cannot read {WEIGHTS_FILE} ({e}).") from None
    expected = module_shapes(hf_config)
    num_layers = int(hf_config["num_hidden_layers"])
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    vocab_shape = (int(hf_config["vocab_size"]), int(hf_config["hidden_size"]))
    for key, shape in shapes.items():
        if _BASE_COPY_KEY.match(key):
            if shape != vocab_shape:
                raise ValueError(f"LoRA adapter {path!r}: {key} is {list(shape)}, the base model's "
                                 f"is {list(vocab_shape)}; adapters with a resized vocabulary are "
                                 f"not supported.")
            continue
        parsed = _parse_key(key)
        if parsed is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA weight of a "
                             f"supported module ({', '.join(SUPPORTED_MODULES)}).")
        layer, module, which = parsed
        if module not in expected or (layer >= 0) != (module in LAYER_MODULES):
            raise ValueError(f"LoRA adapter {path!r}: target module {module!r} ({key}) is not "
                             f"supported; supported: {', '.join(SUPPORTED_MODULES)}.")
        if layer >= num_layers:
            raise ValueError(f"LoRA adapter {path!r}: {key} is for layer {layer}, but the base "
                             f"model has {num_layers} layers.")
        pairs.setdefault((layer, module), {})[which] = shape
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights.")
    if cfg.get("ensure_weight_tying") and any(layer == OUTSIDE_LAYERS for layer, _ in pairs):
        # PEFT then shares one adapter between a tied embedding and LM head.
        raise ValueError(f"LoRA adapter {path!r}: ensure_weight_tying=True (an adapter tied "
                         f"across embed_tokens and lm_head) is not supported by kvserve.")
    out: dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = module if layer == OUTSIDE_LAYERS else f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {where} has lora_"
                             f"{'A' if 'A' in ab else 'B'} but not the other.")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = expected[module]
        r = a[0] if len(a) == 2 else -1
        if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b[0] != fan_out or b[1] != r:
            raise ValueError(
                f"LoRA adapter {path!r}: {where} has lora_A {list(a)} and lora_B "
                f"{list(b)}; the base model needs lora_A [r, {fan_in}] and lora_B [{fan_out}, r] "
                f"(is the adapter for another base model?).")
        if r > lora_config.max_lora_rank:
            raise ValueError(f"LoRA adapter {path!r} has rank {r} ({where}), "
                             f"more than --max-lora-rank {lora_config.max_lora_rank}.")
        out[(layer, module)] = (a, b)
    return out


def load_adapter(lora_int_id: int, lora_name: str, path: str, lora_config: LoRAConfig,
                 hf_config: dict, dtype: torch.dtype = torch.float32) -> LoRAModel:
    """Check, then read the tensors (on CPU); B comes back multiplied by the scaling."""
    shapes = check_adapter(path, lora_config, hf_config)
    cfg = _read_config(path)
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(path, WEIGHTS_FILE), device="cpu")
    model = LoRAModel(lora_int_id, lora_name, rank=max(a[0] for a, _ in shapes.values()))
    for key, t in tensors.items():
        parsed = _parse_key(key)
        if parsed is None:          # a base-weight copy (checked above): kvserve keeps its own
            continue
        layer, module, which = parsed
        if which != "A":
            continue
        b = tensors[key.replace(".lora_A", ".lora_B").replace(".lora_embedding_A",
                                                               ".lora_embedding_B")]
        scaling = _scaling(cfg, t.shape[0])
        model.weights[(layer, module)] = (
            t.to(dtype).contiguous(), (b.double() * scaling).to(dtype).contiguous())
    return model



class AdapterChecker:
    """The frontend's check of a request's adapter, once per (id, path): a bad adapter or an
    id reused for another name is a ValueError (HTTP 400) before anything is scheduled."""

    def __init__(self, lora_config: Optional[LoRAConfig], hf_config: dict) -> None:
        self.lora_config = lora_config
        self.hf_config = hf_config
        self._checked: dict[int, tuple[str, str]] = {}    # id -> (name, path)

    def check(self, lora: Any) -> None:
        from kvserve.lora.request import LoRARequest
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}.")
        if self.lora_config is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} requested, but the engine was "
                             f"started without --enable-lora.")
        seen = self._checked.get(lora.lora_int_id)
        if seen == (lora.lora_name, lora.lora_path):
            return
        if seen is not None and seen[0] != lora.lora_name:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter {seen[0]!r}; "
                             f"{lora.lora_name!r} needs another id.")
        check_adapter(lora.lora_path, self.lora_config, self.hf_config)
        self._checked[lora.lora_int_id] = (lora.lora_name, lora.lora_path)

    def forget(self, lora_int_id: int) -> None:
        self._checked.pop(lora_int_id, None)
