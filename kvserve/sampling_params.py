"""SamplingParams: the per-request generation settings, with vLLM's names and defaults."""
from __future__ import annotations

import enum
from typing import Any, Optional, Union

import msgspec

_GREEDY_EPS = 1e-5
_MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0   # every output carries all tokens so far
    DELTA = 1        # every output carries only the new tokens
    FINAL_ONLY = 2   # one output, when the request finishes


class StructuredOutputsParams(
        msgspec.Struct,
        omit_defaults=True,  # type: ignore[call-arg]
        dict=True):  # type: ignore[call-arg]
    """One output constraint (vLLM's names): exactly one of json, regex, choice, grammar,
    json_object, structural_tag. The grammar itself is checked by the input processor (it
    needs the backend); here only the shape of the request."""

    json: Optional[Union[str, dict[str, Any]]] = None   # a JSON schema (object or its text)
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None                       # EBNF (GBNF-style) grammar
    json_object: Optional[bool] = None                  # any JSON object
    structural_tag: Optional[str] = None                # xgrammar structural tag, as JSON text
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    # Set by a server with --reasoning-parser: the grammar applies only after this token
    # (`</think>`) has been generated; the reasoning before it is free.
    reasoning_end_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {kinds or 'none'}.")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}.")

    def kinds(self) -> list[str]:
        return [k for k in _CONSTRAINT_KINDS
                if getattr(self, k) is not None and getattr(self, k) is not False]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class SamplingParams(
        msgspec.Struct,
        omit_defaults=True,  # type: ignore[call-arg]
        dict=True):  # type: ignore[call-arg]
    """How to sample one request. Validated on construction: bad values raise ValueError
    naming the parameter and the value, before anything reaches the engine."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    extra_args: Optional[dict[str, Any]] = None
    # Set by the input processor from `bad_words` and the tokenizer (vLLM's
    # _bad_words_token_ids): the token sequences the sampler forbids completing.
    bad_words_token_ids: Optional[list[list[int]]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0  # vLLM accepts -1 for "off"
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.logit_bias:
            # JSON object keys arrive as strings; values are clamped like vLLM does.
            self.logit_bias = {
                int(k): max(-_MAX_LOGIT_BIAS, min(_MAX_LOGIT_BIAS, float(v)))
                for k, v in self.logit_bias.items()
            }
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other sampling knobs have no effect; normalise them.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _verify(self) -> None:
        def bad(name: str, value: Any, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise bad(name, v, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be greater than zero")
        if not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int):
            raise bad("top_k", self.top_k, "must be an integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens,
                      f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and self.logprobs < -1:
            raise bad("logprobs", self.logprobs, "must be non-negative (or -1 for all)")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise bad("prompt_logprobs", self.prompt_logprobs, "must be non-negative (or -1 for all)")
        assert isinstance(self.stop, list)
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "cannot contain an empty string")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")
        if self.n > 1 and self.temperature < _GREEDY_EPS:
            # Same rule as vLLM: n copies of a greedy sample are all equal.
            raise bad("n", self.n, "must be 1 when using greedy sampling (temperature=0)")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise bad("allowed_token_ids", self.allowed_token_ids, "must not be empty")

    # ------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or [])

    def clone(self) -> "SamplingParams":
        return msgspec.structs.replace(self)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` into `bad_words_token_ids`, as vLLM does: each word as it
        starts a text and, when that is a different token sequence of the same length, as it
        follows a space (mid-text), so both forms are forbidden."""
        if not self.bad_words:
            return
        ids: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entry {word!r} encodes to no tokens.")
            ids.append(plain)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                ids.append(spaced)
        self.bad_words_token_ids = ids

    def verify_against_vocab(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in range, logprob counts under the cap."""
        def check_ids(name: str, ids: Any) -> None:
            for t in ids or []:
                if not 0 <= int(t) < vocab_size:
                    raise ValueError(f"{name} contains out-of-vocab token id {t} "
                                     f"(vocab size {vocab_size}).")
        check_ids("allowed_token_ids", self.allowed_token_ids)
        check_ids("logit_bias", (self.logit_bias or {}).keys())
        check_ids("stop_token_ids", self.stop_token_ids)
        check_ids("bad_words", [t for seq in self.bad_words_token_ids or [] for t in seq])
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v != -1 and v > max_logprobs:
                raise ValueError(f"Requested {name} of {v}, which is greater than "
                                 f"max_logprobs={max_logprobs}.")
