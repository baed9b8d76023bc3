"""Incremental detokenization and stop strings, one detokenizer per request.

Text is produced with `tokenizers.decoders.DecodeStream` (Rust): each step decodes a short
window of recent ids and emits only what the window added; while the window's text ends in
U+FFFD (a UTF-8 character whose remaining bytes are in tokens not generated yet, as with
byte-level BPE splitting an emoji) it emits nothing and waits for the next token. Two things
are added around it:

* Context: the stream is primed with the prompt's last ids, so the first output token is
  decoded as it reads after the prompt (SentencePiece-style decoders strip a leading space
  from the first token of a sequence).
* Flush: when a request finishes while the stream is still holding ids back (bytes that never
  became a valid character), the held text is decoded and appended, so the final text
  equals `tokenizer.decode(output ids)` (with the one exception below).

One known difference, shared with every streaming detokenizer: SentencePiece-style
ByteFallback decoders turn a whole run of byte tokens that is not valid UTF-8 into one U+FFFD
per byte, including bytes that were valid characters on their own and already streamed. The
stream keeps what it showed (tokenizers' DecodeStream raises "Invalid prefix" there; the
stream is restarted). Valid text always matches a one-shot decode exactly.
`spaces_between_special_tokens` has no effect, as with transformers' fast tokenizers.

Stop strings are checked on the accumulated text. While a request runs, the last
`max(len(stop)) - 1` characters are held back from the caller (unless
include_stop_str_in_output) so streamed text never shows the start of a stop string that a
later token completes and truncation then removes.
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

from tokenizers.decoders import DecodeStream

from kvserve.core.messages import EngineCoreRequest
from kvserve.tokenizer import Tokenizer

# Prompt ids used as decoding context: at least this many (when the prompt has them) ...
_MIN_PROMPT_CONTEXT = 5
# ... and at most this many, looking for a suffix that decodes without U+FFFD.
_MAX_PROMPT_CONTEXT = 24
# Ids before the held-back ones used as context when flushing them.
_FLUSH_CONTEXT = 6
_REPLACEMENT_CHAR = "\ufffd"
# tokenizers' DecodeStreamError::InvalidPrefix: the window's text stopped extending the text
# emitted so far (possible with decoders that are not prefix-monotonic).
_INVALID_PREFIX_ERR = "Invalid prefix"


class IncrementalDetokenizer:
    """Token ids only, no text: for detokenize=False or an engine without a tokenizer.
    FastIncrementalDetokenizer adds the text on top of the same interface."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_text(self) -> str:
        return ""

    def update(self, new_token_ids: list[int], stop_terminated: bool,
               finished: bool = False) -> Optional[str]:
        """Append this step's ids. Returns the stop string that ends the request, if any."""
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    @staticmethod
    def from_new_request(tokenizer: Optional[Tokenizer],
                         request: EngineCoreRequest) -> "IncrementalDetokenizer":
        if tokenizer is None or not request.sampling_params.detokenize:
            return IncrementalDetokenizer()
        return FastIncrementalDetokenizer(tokenizer, request)


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """Text for one request, built step by step (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, request: EngineCoreRequest) -> None:
        super().__init__()
        params = request.sampling_params
        self.request_id = request.request_id
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.skip_special_tokens = params.skip_special_tokens
        # Characters not shown while running: a stop string may still start there.
        self.stop_buffer_length = (max(map(len, self.stop)) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self._text = ""
        self._last_output_text_offset = 0

        self._backend = tokenizer.backend_tokenizer
        context = self._prompt_context(request.prompt_token_ids)
        self._stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        # Every id given to the stream (context included), and how many of them its emitted
        # text covers; the rest are held back (an incomplete character).
        self._fed_ids: list[int] = list(context)
        self._num_emitted = len(context)

    @property
    def output_text(self) -> str:
        return self._text

    def _prompt_context(self, prompt_ids: Sequence[int]) -> list[int]:
        n = len(prompt_ids)
        # Shortest suffix of at least _MIN_PROMPT_CONTEXT ids that is whole characters; a
        # suffix that decodes to U+FFFD would make the stream's prefix check fail.
        for k in range(min(n, _MIN_PROMPT_CONTEXT), min(n, _MAX_PROMPT_CONTEXT) + 1):
            suffix = list(prompt_ids[n - k:])
            if _REPLACEMENT_CHAR not in self._backend.decode(
                    suffix, skip_special_tokens=self.skip_special_tokens):
                return suffix
        return []

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: list[int]) -> None:
        if not ids:
            return
        # Several ids in one step (speculative decoding, prefill of a resumed request): one
        # Rust call. If their text ends mid-character the stream returns nothing at all, so
        # that rare case is redone id by id from a copy, to emit the complete part now.
        snapshot = copy.copy(self._stream) if len(ids) > 1 else None
        if self._step(ids) is None and snapshot is not None:
            self._stream = snapshot
            del self._fed_ids[len(self._fed_ids) - len(ids):]
            for i in ids:
                self._step([i])

    def _step(self, ids: list[int]) -> Optional[str]:
        self._fed_ids.extend(ids)
        try:
            chunk = self._stream.step(self._backend, ids)
        except Exception as e:  # tokenizers raises a plain Exception subclass
            if _INVALID_PREFIX_ERR not in str(e):
                raise
            chunk = self._restart_stream()
        if chunk is not None:
            self._text += chunk
            self._num_emitted = len(self._fed_ids)
        return chunk

    def _restart_stream(self) -> Optional[str]:
        """Recover from InvalidPrefix: start a new stream primed with the ids already emitted
        and replay the held-back ones (the text emitted so far is kept as it is)."""
        held = self._fed_ids[self._num_emitted:]
        context = self._fed_ids[max(0, self._num_emitted - _FLUSH_CONTEXT):self._num_emitted]
        if _REPLACEMENT_CHAR in self._backend.decode(
                context, skip_special_tokens=self.skip_special_tokens):
            context = []
        self._stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        try:
            return self._stream.step(self._backend, held)
        except Exception as e:
            if _INVALID_PREFIX_ERR not in str(e):
                raise
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self._stream.step(self._backend, held)

    def _flush(self) -> None:
        """The request is over: emit held-back ids as they decode (U+FFFD for bytes that
        never formed a character), matching a one-shot decode of all ids."""
        if self._num_emitted == len(self._fed_ids):
            return
        held = self._fed_ids[self._num_emitted:]
        context = self._fed_ids[max(0, self._num_emitted - _FLUSH_CONTEXT):self._num_emitted]
        skip = self.skip_special_tokens
        full = self._backend.decode(context + held, skip_special_tokens=skip)
        prefix = self._backend.decode(context, skip_special_tokens=skip)
        self._text += (full[len(prefix):] if full.startswith(prefix)
                       else self._backend.decode(held, skip_special_tokens=skip))
        self._num_emitted = len(self._fed_ids)

    # ------------------------------------------------------------------ per step
    def update(self, new_token_ids: list[int], stop_terminated: bool,
               finished: bool = False) -> Optional[str]:
        """Decode this step's ids and look for stop strings.

        stop_terminated: the engine stopped on the last id (EOS or a stop token id); its text
        is left out unless include_stop_str_in_output, but the id stays in token_ids.
        finished: the request ends with this step (held-back bytes are flushed).
        Returns the stop string found, after truncating the text at it.
        """
        num_before = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        to_decode = (new_token_ids[:-1] if stop_terminated and new_token_ids
                     and not self.include_stop_str_in_output else new_token_ids)

        # Text of the first min_tokens ids is never searched for stop strings.
        stop_check_offset = len(self._text)
        if self.min_tokens and num_before < self.min_tokens:
            head = self.min_tokens - num_before
            self._decode(to_decode[:head])
            to_decode = to_decode[head:]
            stop_check_offset = len(self._text)
        self._decode(to_decode)
        if finished:
            self._flush()

        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(self._text, len(self._text) - stop_check_offset,
                                   self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop_str, truncate_to = match
        self._text = self._text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it, or (delta) what was not reported before. The
        stop-string hold-back applies until the request is finished."""
        end = len(self._text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self._text[:max(end, 0)]
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self._text[start:end]


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> Optional[tuple[str, int]]:
    """Find a stop string that ends inside the last `new_char_count` characters.

    Only the tail that can hold a new match is searched (a match must end among the new
    characters; earlier ones were checked on earlier steps). Of several matches, the one that
    ends first wins (then the longer one): that is the one a token-by-token stream would have
    met first, so the result does not depend on how the text was split into steps.

    Returns (stop string, length to truncate the text to): the match's start, or its end
    when include_in_output. None when nothing matched.
    """
    if new_char_count <= 0 or not stop:
        return None
    text_len = len(output_text)
    best: Optional[tuple[int, int, str]] = None  # (end, start, stop string)
    for s in stop:
        start = output_text.find(s, max(0, text_len - new_char_count - len(s) + 1))
        if start == -1:
            continue
        key = (start + len(s), start, s)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    end, start, s = best
    return s, (end if include_in_output else start)
