"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): the reasoning a model writes
between `<think>` and `</think>` goes to `reasoning_content`, the rest to `content`.

Like the tool parsers, `parse(text, final)` is monotone (the reasoning and the content of a
longer text extend those of a shorter one; a tail that may become a marker is held back until
`final`), so one diff (`ReasoningStreamer`) makes the stream, and the non-streamed answer is
the same streamer fed once: the two agree for every way the text is cut into deltas.

Both markers must be tokens of the model's vocabulary: the engine recognises the end of the
reasoning by the `</think>` token id (structured outputs start there), and a parser for a model
without them is an error at start.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from kvserve.entrypoints.openai.tool_parsers.abstract_tool_parser import partial_marker


class ReasoningParser:
    start_token = "<think>"
    end_token = "</think>"
    name = ""

    def __init__(self, tokenizer: Any) -> None:
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.start_token, self.end_token) if t not in vocab]
        if missing:
            raise ValueError(f"--reasoning-parser {self.name}: the model's tokenizer has no "
                             f"{' and no '.join(missing)} token, so this model does not write "
                             f"reasoning this parser can find.")
        self.start_token_id: int = vocab[self.start_token]
        self.end_token_id: int = vocab[self.end_token]

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether these ids (a prompt) leave the reasoning closed: the last of the two markers
        in them is `</think>` (a template that turns thinking off writes "<think></think>")."""
        for token in reversed(token_ids):
            if token == self.end_token_id:
                return True
            if token == self.start_token_id:
                return False
        return False

    def thinks(self, chat_template_kwargs: Optional[dict[str, Any]]) -> bool:
        """Whether a request with these template arguments reasons at all."""
        return True

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the generated text so far. Everything before `</think>` is
        reasoning (the prompt may hold the `<think>`; one written by the model is dropped); with
        no `</think>` (yet) all of it is."""
        end = text.find(self.end_token)
        if end < 0:
            keep = 0 if final else partial_marker(text, self.start_token, self.end_token)
            return self._strip_start(text[:len(text) - keep]), ""
        return self._strip_start(text[:end]), text[end + len(self.end_token):]

    def _strip_start(self, reasoning: str) -> str:
        before, marker, after = reasoning.partition(self.start_token)
        return before + after if marker else reasoning


class ReasoningStreamer:
    """Diffs successive parses into (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._sent = (0, 0)

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.parse(self.text, final)
        sent_r, sent_c = self._sent
        self._sent = (max(sent_r, len(reasoning)), max(sent_c, len(content)))
        return reasoning[sent_r:], content[sent_c:]
