"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, EBNF,
structural tags) through a backend (xgrammar), driven by the engine core's
StructuredOutputManager; the workers only apply the per-step token bitmask."""
from kvserve.structured_output.bitmask import apply_grammar_bitmask

__all__ = ["apply_grammar_bitmask"]
