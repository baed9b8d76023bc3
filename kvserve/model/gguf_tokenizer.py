"""The tokenizer a GGUF file describes in its metadata, as the parts of a kvserve `Tokenizer`
(kvserve/tokenizer.py builds it from them: model/ does not import the tokenizer above it).

vLLM gets it through transformers' GGUF tokenizer conversion; kvserve does the same conversion
itself with `tokenizers` (transformers is not a dependency of kvserve), for llama.cpp's byte-level
BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: Llama 3, Qwen2/3, SmolLM, Mistral Nemo):
vocabulary and merges as stored, the split regex that `tokenizer.ggml.pre` names (GPT-2's
byte-level split for any other), control tokens as special added tokens, user-defined ones as
plain added tokens, BOS/EOS as `tokenizer.ggml.add_bos_token` / `add_eos_token` say, and the
chat template of `tokenizer.chat_template`. SentencePiece vocabularies ("llama") need the
model's Hugging Face tokenizer: `--tokenizer DIR`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

from kvserve.model.gguf import GGUFMetadata, read_gguf_metadata

_CONTROL, _USER_DEFINED = 3, 4       # llama.cpp token types

# Split regexes by `tokenizer.ggml.pre` (the pre-tokenizers of these vocabularies' HF repos).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _backend(meta: GGUFMetadata) -> Any:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    f = meta.fields
    tokens: list[str] = list(f["tokenizer.ggml.tokens"])
    types: list[int] = list(f.get("tokenizer.ggml.token_type") or [])
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
               for t in tokens]
    merges = [tuple(m.split(" ")) for m in f.get("tokenizer.ggml.merges") or []]
    tok = RustTokenizer(models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges,
                                   dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(f.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabelled byte piece: skip it.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types)
                            if ty == _CONTROL and set(t) <= letters])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty, s in zip(tokens, types, spelled) if ty == _USER_DEFINED and t == s])
    post = _post_processor(f, tokens)
    if post is not None:
        tok.post_processor = post
    return tok


def _post_processor(f: dict[str, Any], tokens: list[str]) -> Any:
    """BOS / EOS around the text where `tokenizer.ggml.add_bos_token` / `add_eos_token` say so."""
    from tokenizers import processors

    def added(flag: str, key: str) -> list[tuple[str, int]]:
        token_id = f.get(f"tokenizer.ggml.{key}")
        if not f.get(flag) or token_id is None:
            return []
        return [(tokens[int(token_id)], int(token_id))]

    bos = added("tokenizer.ggml.add_bos_token", "bos_token_id")
    eos = added("tokenizer.ggml.add_eos_token", "eos_token_id")
    if not bos and not eos:
        return None

    def side(seq: str, type_id: int) -> str:
        return " ".join([f"{t}:{type_id}" for t, _ in bos] + [f"{seq}:{type_id}"]
                        + [f"{t}:{type_id}" for t, _ in eos])

    return processors.TemplateProcessing(single=side("$A", 0),
                                         pair=side("$A", 0) + " " + side("$B", 1),
                                         special_tokens=list(dict.fromkeys(bos + eos)))


def tokenizer_parts_from_gguf(path: str) -> tuple[Any, dict[str, Any], Optional[str]]:
    """(`tokenizers` backend, tokenizer_config-style dict, chat template) of a GGUF file, built
    from its metadata: what kvserve's Tokenizer is made of."""
    meta = read_gguf_metadata(path)
    model = meta.fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF file {path} has a {model!r} tokenizer; kvserve builds byte-level BPE ('gpt2') "
            f"tokenizers from GGUF metadata only. Pass --tokenizer with the model's Hugging Face "
            f"tokenizer directory (tokenizer.json).")
    tokens = meta.fields["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {}
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.fields.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[role] = tokens[int(token_id)]
    context = meta.get("context_length")
    if context:
        config["model_max_length"] = int(context)
    return _backend(meta), config, meta.fields.get("tokenizer.chat_template")
