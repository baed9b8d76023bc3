"""The pieces under the manager: the bitmask op (against xgrammar's own), the tokenizer info
built from our tokenizer, matcher rollback, jump-forward text, and the no-xgrammar error."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from kvserve.structured_output.bitmask import apply_grammar_bitmask, unpack_bitmask
from kvserve.tokenizer import Tokenizer


def test_bitmask_matches_xgrammar_and_leaves_other_rows_alone() -> None:
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    vocab, words = 1000, (1000 + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64)
    bitmask = bits.to(torch.int32).numpy()
    logits = torch.randn(5, vocab, generator=g)
    rows = np.array([4, 0, 2])
    ours = apply_grammar_bitmask(logits, bitmask, rows)
    theirs = logits.clone()
    full = torch.full((5, words), -1, dtype=torch.int32)       # all allowed
    full[torch.from_numpy(rows)] = torch.from_numpy(bitmask)
    xgr.apply_token_bitmask_inplace(theirs, full, backend="cpu")
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])          # unconstrained rows untouched
    assert not torch.equal(logits, ours)                       # the caller's logits unchanged


def test_unpack_pads_a_short_bitmask_with_disallowed() -> None:
    bitmask = torch.tensor([[-1]], dtype=torch.int32)          # 32 tokens allowed
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed[0, :32].all() and not allowed[0, 32:].any()


@pytest.fixture(scope="module")
def backend(tiny_llama: str):
    from kvserve.structured_output.backend_xgrammar import XgrammarBackend
    tok = Tokenizer.from_pretrained(tiny_llama)
    # The model's vocabulary (1024) is larger than the tokenizer's.
    return tok, XgrammarBackend(tok, 1024, sorted(tok.eos_token_ids))


def test_tokenizer_info_from_our_tokenizer(backend) -> None:
    import xgrammar as xgr
    tok, be = backend
    assert be.tokenizer_info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert be.vocab_size == 1024 and tok.vocab_size < 1024
    grammar = be.make_grammar(be.compile_grammar("regex", "[a-z ]+"))
    mask = np.zeros((1, be.num_bitmask_words()), dtype=np.int32)
    be.fill_bitmasks([grammar], mask)
    allowed = unpack_bitmask(torch.from_numpy(mask), 1024)[0]
    ids = allowed.nonzero().flatten().tolist()
    assert ids and max(ids) < tok.vocab_size                   # padding ids never allowed
    for t in ids:                                              # and each one fits the regex
        assert set(tok.decode([t])) <= set("abcdefghijklmnopqrstuvwxyz "), tok.decode([t])


def test_matcher_accepts_rolls_back_and_terminates(backend) -> None:
    tok, be = backend
    grammar = be.make_grammar(be.compile_grammar("grammar", 'root ::= "ab" "c"'))
    ids = tok.encode("abc", add_special_tokens=False)
    assert grammar.accept_tokens("r", ids)
    assert not grammar.is_terminated()                         # waits for its stop token
    grammar.rollback(len(ids))
    assert grammar.validate_tokens(ids + ids) == ids           # validate does not advance
    assert grammar.accept_tokens("r", ids) and grammar.accept_tokens("r", sorted(tok.eos_token_ids)[:1])
    assert grammar.is_terminated()
    fresh = be.make_grammar(be.compile_grammar("grammar", 'root ::= "ab" "c"'))
    assert not fresh.accept_tokens("r", tok.encode("x", add_special_tokens=False))


def test_jump_forward_string_of_fixed_keys(backend) -> None:
    _, be = backend
    schema = '{"type": "object", "properties": {"a_long_key": {"type": "integer"}}, "required": ["a_long_key"]}'
    grammar = be.make_grammar(be.compile_grammar("json", (schema, False)))
    assert grammar.jump_forward_string() == '{"a_long_key":'   # no whitespace: compact


def test_without_xgrammar_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.sampling_params import StructuredOutputsParams
    from kvserve.structured_output.backend_xgrammar import validate_xgrammar_params
    monkeypatch.setitem(sys.modules, "xgrammar", None)         # import xgrammar now fails
    with pytest.raises(ValueError, match=r"pip install 'kvserve\[structured\]'"):
        validate_xgrammar_params(StructuredOutputsParams(regex="a+"))
