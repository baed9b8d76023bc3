"""Tokenizer: a Hugging Face `tokenizer.json` + `tokenizer_config.json`, without `transformers`.

Wraps a `tokenizers.Tokenizer` (Rust) and adds what the config files carry on top of it: the
special tokens by role (bos / eos / unk / pad), the EOS ids of `generation_config.json`, and the
chat template, rendered in a sandboxed jinja2 environment set up the way `transformers` sets
up its own, so that a checkpoint's template renders the same text here as there.

Chat prompts and BOS: most templates write `{{ bos_token }}` themselves, so the rendered text
already starts with BOS. Encode rendered chat text with `add_special_tokens=False` (this is
what `apply_chat_template(..., tokenize=True)` does), or the prompt starts with two BOS tokens.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence, Union

import tokenizers
from tokenizers import processors

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON_FILE = "chat_template.json"

# The roles transformers knows, in its order (this is the order of `all_special_ids`).
_SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token",
                        "pad_token", "cls_token", "mask_token")

# Tokenizer classes whose post-processor transformers rebuilds from add_bos_token /
# add_eos_token; for every other class tokenizer.json's post-processor is authoritative.
_FLAG_DRIVEN_CLASSES = {"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer",
                        "CodeLlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast"}


def _token_content(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    """Encode / decode / chat templates for one checkpoint (see the module docstring)."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Optional[dict] = None,
                 generation_config: Optional[dict] = None,
                 chat_template: Union[str, dict[str, str], None] = None,
                 name_or_path: str = "") -> None:
        self._tok = backend
        self.config = dict(config or {})
        self.generation_config = dict(generation_config or {})
        self.name_or_path = name_or_path
        self.model_max_length: Optional[int] = self.config.get("model_max_length")
        self.chat_template = chat_template

        self.special_tokens_map: dict[str, str] = {}
        for role in _SPECIAL_TOKEN_ROLES:
            content = _token_content(self.config.get(role))
            if content is not None:
                self.special_tokens_map[role] = content
        extra = (self.config.get("additional_special_tokens")
                 or self.config.get("extra_special_tokens") or [])
        if isinstance(extra, dict):   # transformers 5 may write a role -> token mapping
            extra = list(extra.values())
        self.additional_special_tokens = [t for t in map(_token_content, extra) if t is not None]

        self._maybe_rebuild_post_processor()
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._decoded_token_cache: dict[int, str] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        """Load from a checkpoint directory (or a tokenizer.json file path), or build it from
        a GGUF file's metadata."""
        if os.path.isfile(path) and _is_gguf_file(path):
            from kvserve.model.gguf_tokenizer import tokenizer_parts_from_gguf
            backend, config, template = tokenizer_parts_from_gguf(path)
            return cls(backend, config, chat_template=template, name_or_path=path)
        if os.path.isfile(path) and os.path.basename(path) == TOKENIZER_FILE:
            path = os.path.dirname(path) or "."
        if not os.path.isdir(path):
            raise ValueError(f"Tokenizer path {path!r} is not a directory; expected a checkpoint "
                             f"directory containing {TOKENIZER_FILE}.")
        tok_file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(tok_file):
            raise ValueError(f"Tokenizer directory {path!r} has no {TOKENIZER_FILE} (only fast "
                             f"tokenizers are supported: convert tokenizer.model with "
                             f"transformers' `AutoTokenizer.save_pretrained`).")
        backend = tokenizers.Tokenizer.from_file(tok_file)
        cfg_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
        config = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}
        gen_file = os.path.join(path, GENERATION_CONFIG_FILE)
        gen_config = _read_json(gen_file) if os.path.isfile(gen_file) else {}
        return cls(backend, config, gen_config, _load_chat_template(path, config), path)

    def _maybe_rebuild_post_processor(self) -> None:
        # Same rule as transformers' LlamaTokenizerFast.update_post_processor: for these
        # classes add_bos_token / add_eos_token decide which special tokens encode() adds.
        if self.config.get("tokenizer_class") not in _FLAG_DRIVEN_CLASSES:
            return
        if "add_bos_token" not in self.config and "add_eos_token" not in self.config:
            return
        bos, eos = self.bos_token, self.eos_token
        add_bos = bool(self.config.get("add_bos_token", True)) and bos is not None
        add_eos = bool(self.config.get("add_eos_token", False)) and eos is not None
        single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
        pair = (single + (f" {bos}:1" if add_bos else "") + " $B:1"
                + (f" {eos}:1" if add_eos else ""))
        special = []
        if add_bos:
            special.append((bos, self._tok.token_to_id(bos)))
        if add_eos:
            special.append((eos, self._tok.token_to_id(eos)))
        if any(i is None for _, i in special):
            return  # the config names a token the vocabulary lacks; keep tokenizer.json's rule
        self._tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special)

    # ------------------------------------------------------------------ special tokens
    def _role_id(self, role: str) -> Optional[int]:
        content = self.special_tokens_map.get(role)
        return None if content is None else self._tok.token_to_id(content)

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (used by the incremental detokenizer)."""
        return self._tok

    @property
    def bos_token(self) -> Optional[str]:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> Optional[str]:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> Optional[str]:
        return self.special_tokens_map.get("pad_token")

    @property
    def unk_token(self) -> Optional[str]:
        return self.special_tokens_map.get("unk_token")

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._role_id("bos_token")

    @property
    def eos_token_id(self) -> Optional[int]:
        return self._role_id("eos_token")

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._role_id("pad_token")

    @property
    def unk_token_id(self) -> Optional[int]:
        return self._role_id("unk_token")

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: tokenizer_config's eos_token plus generation_config's
        eos_token_id (an int or a list; chat models often list the end-of-turn token there)."""
        ids: set[int] = set()
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        gen = self.generation_config.get("eos_token_id")
        if isinstance(gen, int):
            ids.add(gen)
        elif isinstance(gen, list):
            ids.update(int(i) for i in gen)
        return ids

    @property
    def all_special_tokens(self) -> list[str]:
        """Special tokens declared in tokenizer_config.json, in transformers' order."""
        seen: dict[str, None] = {}
        for role in _SPECIAL_TOKEN_ROLES:
            if role in self.special_tokens_map:
                seen.setdefault(self.special_tokens_map[role])
        for t in self.additional_special_tokens:
            seen.setdefault(t)
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self._tok.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    # ------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (what `len(hf_tokenizer)` returns)."""
        return self._vocab_size

    @property
    def max_token_id(self) -> int:
        return self._vocab_size - 1

    def __len__(self) -> int:
        return self._vocab_size

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Union[int, Iterable[int]]) -> Any:
        """Vocabulary strings (byte-level symbols, not text); None for unknown ids."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Union[str, Iterable[str]]) -> Any:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. add_special_tokens applies the checkpoint's post-processor
        (usually a leading BOS); pass False for text that already contains them (chat)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str],
                     add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id decoded on its own (special tokens kept), as logprobs show them.

        Memoized per id: logprobs ask for the same few thousand ids over and over, and one
        batched Rust call fills whatever is missing.
        """
        cache = self._decoded_token_cache
        try:
            return list(map(cache.__getitem__, ids))
        except KeyError:
            missing = [i for i in dict.fromkeys(ids) if i not in cache]
            texts = self._tok.decode_batch([[i] for i in missing], skip_special_tokens=False)
            cache.update(zip(missing, texts))
            return list(map(cache.__getitem__, ids))

    # ------------------------------------------------------------------ chat
    def get_chat_template(self, chat_template: Optional[str] = None,
                          tools: Optional[list] = None) -> str:
        """The template source to render: `chat_template` itself, or one of the checkpoint's
        named templates (by name, "tool_use" when tools are given, else "default")."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise ValueError(f"This tokenizer has named chat templates {sorted(own)} and none is "
                             f"called 'default'; pass chat_template=<name or template>.")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError(
                f"The tokenizer at {self.name_or_path!r} has no chat template (no chat_template in "
                f"{TOKENIZER_CONFIG_FILE}, no {CHAT_TEMPLATE_FILE}); pass chat_template=... "
                f"(a Jinja template string) to use chat.")
        return own

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, tokenize: bool = False,
                            continue_final_message: bool = False, tools: Optional[list] = None,
                            documents: Optional[list] = None,
                            **template_kwargs: Any) -> Union[str, list[int]]:
        """Render a conversation with the chat template, as `transformers` does.

        Returns the text, or with tokenize=True its token ids encoded with
        add_special_tokens=False (the template writes BOS itself). Template errors, including
        `raise_exception(...)` calls such as "roles must alternate", become ValueError.
        """
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt are mutually "
                                 "exclusive: the first continues the last message, the second "
                                 "starts a new assistant turn.")
            if not messages:
                raise ValueError("continue_final_message needs at least one message.")
        import jinja2

        source = self.get_chat_template(chat_template, tools)
        context = dict(self.special_tokens_map)
        context.update(template_kwargs)
        try:
            rendered = _compile_chat_template(source).render(
                messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ValueError(f"Chat template error: {e}") from e
        if continue_final_message:
            rendered = _cut_after_final_message(rendered, messages[-1])
        if tokenize:
            return self.encode(rendered, add_special_tokens=False)
        return rendered

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


def _is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _load_chat_template(path: str, config: dict) -> Union[str, dict[str, str], None]:
    """chat_template.jinja wins over chat_template.json over tokenizer_config.json (newer
    transformers versions save the template in its own file)."""
    jinja_file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template: Any = config.get("chat_template")
    json_file = os.path.join(path, CHAT_TEMPLATE_JSON_FILE)
    if os.path.isfile(json_file):
        template = _read_json(json_file).get("chat_template", template)
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in template}
    return template


def _raise_exception(message: str) -> None:
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple] = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_chat_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"Chat template syntax error (line {e.lineno}): {e.message}") from e


def _cut_after_final_message(rendered: str, final_message: dict) -> str:
    """continue_final_message: drop what the template appended after the last message's
    content (its end-of-turn tokens), so generation continues that message."""
    content = final_message.get("content")
    if isinstance(content, list):  # OpenAI content parts: continue the last text part
        texts = [p.get("text", "") for p in content
                 if isinstance(p, dict) and p.get("type") == "text"]
        content = texts[-1] if texts else ""
    content = (content or "").strip()
    idx = rendered.rfind(content) if content else -1
    if idx == -1:
        raise ValueError("continue_final_message: the final message's content does not appear in "
                         "the rendered chat template.")
    return rendered[:idx + len(content)]
