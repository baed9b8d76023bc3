"""The xgrammar backend: compile constraints into token-level grammars and match them.

The tokenizer info is built from our `tokenizers`-library tokenizer (not a transformers
object): the encoded vocabulary in id order plus the vocabulary type read off tokenizer.json's
decoder (ByteLevel, ByteFallback or raw). The model's vocabulary may be larger than the
tokenizer's; the extra ids are never allowed.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

from kvserve.structured_output.backend_types import (StructuredOutputBackend,
                                                     StructuredOutputGrammar)

INSTALL_HINT = ("structured outputs need the xgrammar package: "
                "pip install 'kvserve[structured]' (or pip install xgrammar)")


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"{INSTALL_HINT} ({e}).") from None
    return xgrammar


def _vocab_type(xgr: Any, tokenizer_json: dict) -> tuple[Any, bool]:
    """(VocabType, add_prefix_space) from tokenizer.json's decoder and pre-tokenizer."""
    decoder = tokenizer_json.get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in kinds:
        # SentencePiece style: "▁" marks a space; a leading one is added when Prepend/Metaspace says so.
        text = json.dumps(tokenizer_json.get("normalizer")) + json.dumps(
            tokenizer_json.get("pre_tokenizer"))
        return xgr.VocabType.BYTE_FALLBACK, ("Prepend" in text or "prepend_scheme" in text)
    return xgr.VocabType.RAW, False


def build_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's TokenizerInfo for our Tokenizer (kvserve.tokenizer.Tokenizer)."""
    xgr = import_xgrammar()
    backend = tokenizer.backend_tokenizer
    tok_json = json.loads(backend.to_str())
    vocab = tokenizer.get_vocab()
    size = max(vocab_size, max(vocab.values()) + 1)
    encoded: list[str] = [""] * size
    for token, idx in vocab.items():
        encoded[idx] = token
    vocab_type, add_prefix_space = _vocab_type(xgr, tok_json)
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=size,
                             stop_token_ids=sorted(stop_token_ids) or None,
                             add_prefix_space=add_prefix_space)


def _json_schema_text(spec: Any) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec)


# xgrammar (0.2.x) writes the characters of a string with minLength / maxLength as this class,
# which admits raw control characters (U+0000-U+001F but CR and LF): strict JSON parsers refuse
# them. Its plain string rule already excludes them; the bounded one is made to match.
_LOOSE_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def json_schema_grammar(xgr: Any, schema_text: str, any_whitespace: bool) -> Any:
    """The xgrammar Grammar of a JSON schema whose every output parses with a strict JSON
    parser. Without any_whitespace (`disable_any_whitespace`) the output has no whitespace
    at all outside strings: "," and ":" separators, as json.dumps(separators=(",", ":"))."""
    kwargs = {} if any_whitespace else {"separators": (",", ":")}
    grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=any_whitespace, **kwargs)
    ebnf = str(grammar)
    fixed = ebnf.replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS)
    return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)


# Bounds on a constraint, checked before it is parsed: the frontend parses on the API server's
# event loop and the engine compiles with memory that grows with the spec; a schema nested 200
# deep takes seconds just to parse. Real schemas (tool definitions included) are far smaller.
MAX_SPEC_CHARS = 256 * 1024
MAX_SCHEMA_DEPTH = 48


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of a JSON value, counted up to `limit` + 1 (no deeper walk)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_spec_size(kind: str, spec: Any) -> None:
    text = spec if isinstance(spec, str) else json.dumps(spec)
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{kind} is {len(text)} characters long; at most "
                         f"{MAX_SPEC_CHARS} are accepted.")
    if kind == "json" and not isinstance(spec, str) and _depth(spec, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"structured_outputs.json is nested deeper than {MAX_SCHEMA_DEPTH} "
                         f"levels.")


def validate_xgrammar_params(params: Any) -> None:
    """Cheap checks the frontend runs before a request is accepted (no token masks built):
    bound the spec's size, then parse the schema / regex / EBNF into an xgrammar Grammar.
    Raises ValueError naming the problem."""
    kind = params.kind
    if kind in ("json", "regex", "grammar", "structural_tag", "choice"):
        check_spec_size(kind, getattr(params, kind))
    xgr = import_xgrammar()
    try:
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            check_spec_size(kind, schema)
            json_schema_grammar(xgr, json.dumps(schema), not params.disable_any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(params.grammar)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(params.structural_tag)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / its own errors on bad specs
        raise ValueError(f"Invalid structured_outputs.{kind}: {e}") from None


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, xgr: Any, matcher: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_processed_tokens = 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for t in tokens:
            if not self.matcher.accept_token(t):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return tokens[:accepted]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def jump_forward_string(self) -> str:
        return self.matcher.find_jump_forward_string()

    def reset(self) -> None:
        self.num_processed_tokens = 0
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 disable_any_whitespace: bool = False, max_threads: int = 2) -> None:
        self.xgr = import_xgrammar()
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.tokenizer_info.vocab_size
        self.disable_any_whitespace = disable_any_whitespace
        # The compiler has its own cache; ours (by kind, spec) sits in front of it.
        self.compiler = self.xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self.batch_matcher = self.xgr.BatchGrammarMatcher(max_threads=max_threads)

    def compile_grammar(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        try:
            if kind == "json":
                text, any_ws = spec
                return c.compile_grammar(json_schema_grammar(self.xgr, text, any_ws))
            if kind == "json_object":
                # OpenAI's json_object is an object (xgrammar's builtin JSON allows any value).
                return c.compile_grammar(json_schema_grammar(self.xgr, '{"type": "object"}', spec))
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "structural_tag":
                return c.compile_structural_tag(spec)
        except Exception as e:
            raise ValueError(f"Invalid structured_outputs.{kind}: {e}") from None
        raise ValueError(f"Unknown structured output kind {kind!r}.")

    def make_grammar(self, compiled: Any) -> XgrammarGrammar:
        matcher = self.xgr.GrammarMatcher(compiled)   # rollback depth is unlimited
        return XgrammarGrammar(self.xgr, matcher, self.vocab_size)

    def num_bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def fill_bitmasks(self, grammars: list[XgrammarGrammar], bitmask: np.ndarray,
                      rows: Optional[list[int]] = None) -> None:
        """Rows 0..len(grammars)-1 of `bitmask` (or `rows`), filled by xgrammar's threads in
        one call."""
        self.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask,
                                                         rows)
