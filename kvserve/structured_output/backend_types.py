"""The backend interface the StructuredOutputManager talks to (vLLM's shape).

A backend compiles a (kind, spec) pair into a reusable compiled grammar; each request gets its
own `StructuredOutputGrammar` (a matcher with state) built from that compiled grammar.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import numpy as np


class StructuredOutputGrammar(ABC):
    """One request's matcher: which tokens may come next, advanced token by token."""

    @abstractmethod
    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        """Advance over `tokens`; False (state unchanged past the first bad one) if refused."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar accepts, without advancing."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative tokens that were rejected)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token: the request is done."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The text the grammar forces from here (its only continuation); may be empty."""

    @abstractmethod
    def reset(self) -> None:
        ...


class StructuredOutputBackend(ABC):
    @abstractmethod
    def compile_grammar(self, kind: str, spec: Any) -> Any:
        """Compile a constraint; runs in a worker thread. Raises ValueError on a bad spec."""

    @abstractmethod
    def make_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over a compiled grammar (cheap)."""

    @abstractmethod
    def num_bitmask_words(self) -> int:
        ...

    @abstractmethod
    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: np.ndarray,
                      rows: Optional[list[int]] = None) -> None:
        """Fill rows 0..len(grammars)-1 of `bitmask` (int32 [rows, num_bitmask_words]), or
        row rows[i] for grammars[i]."""
