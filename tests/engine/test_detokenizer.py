"""Incremental detokenization equals one-shot decoding; stop strings are found once, early."""
from __future__ import annotations

import json
import random

import pytest

from kvserve.core.messages import EngineCoreRequest
from kvserve.engine.detokenizer import (FastIncrementalDetokenizer, IncrementalDetokenizer,
                                        check_stop_strings)
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(demo_tokenizer_dir: str) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_tok(demo_tokenizer_dir: str):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(demo_tokenizer_dir)


def _request(prompt_ids: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest("r", prompt_ids, SamplingParams(**params), [2], 0.0)


def _stream(tok: Tokenizer, prompt: list[int], out: list[int], chunks: list[int] | None = None,
            **params) -> tuple[FastIncrementalDetokenizer, list[str]]:
    """Feed `out` in steps of the given sizes; return the detokenizer and the text after
    every step (checking on the way that emitted text is never taken back)."""
    d = FastIncrementalDetokenizer(tok, _request(prompt, **params))
    texts, i = [], 0
    for size in chunks or [1] * len(out):
        step = out[i:i + size]
        i += size
        d.update(step, False, finished=i >= len(out))
        if texts:
            assert d.output_text.startswith(texts[-1]), "emitted text changed"
        texts.append(d.output_text)
    assert i >= len(out)
    return d, texts


def _bytes_tokens(tok: Tokenizer, text: str) -> list[int]:
    """`text` as one token per UTF-8 byte (byte-level BPE has a token for every byte)."""
    from tokenizers.pre_tokenizers import ByteLevel

    # ByteLevel maps each byte to one printable character: the byte's token in the vocab.
    [(mapped, _)] = ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    assert len(mapped) == len(text.encode("utf-8"))
    ids = [tok.token_to_id(c) for c in mapped]
    assert None not in ids
    return ids


# ---------------------------------------------------------------------- equality with decode
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_decode(tok, hf_tok, skip_special_tokens):
    """Uniform random ids (a quarter of this vocabulary is single bytes, so characters are
    split in every way, and invalid UTF-8 occurs): the streamed text must end equal to a
    one-shot decode, here and in transformers."""
    rng = random.Random(1234 + skip_special_tokens)
    vocab = tok.vocab_size
    for _ in range(400):
        prompt = tok.encode(rng.choice(["Hello world", "café", "🙂 east", "x"]))
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        chunks = [rng.randrange(1, 4) for _ in range(len(out))]
        d, _ = _stream(tok, prompt, out, chunks, skip_special_tokens=skip_special_tokens)
        expected = tok.decode(out, skip_special_tokens=skip_special_tokens)
        assert d.output_text == expected, (prompt, out)
        assert expected == hf_tok.decode(out, skip_special_tokens=skip_special_tokens)
        assert d.output_token_ids == out


def test_text_sequences_never_show_partial_characters(tok, hf_tok):
    """Valid text tokenized normally and byte by byte: no intermediate text ends in U+FFFD
    (a character still being completed) and every text is a prefix of the final one."""
    rng = random.Random(7)
    pool = list("abc xyz") + ["é", "ü", "ß", "東", "京", "語", "🙂", "🚀", "✓", "한", "\n"]
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 20)))
        for out in (tok.encode(text, add_special_tokens=False), _bytes_tokens(tok, text)):
            d, texts = _stream(tok, tok.encode("Hi"), out)
            assert d.output_text == text == hf_tok.decode(out)
            assert not any(t.endswith(REPLACEMENT) for t in texts)
            assert REPLACEMENT not in d.output_text


@pytest.mark.parametrize("char", ["é", "€", "東", "🙂"])
def test_split_character_appears_when_complete(tok, char):
    ids = _bytes_tokens(tok, "a" + char + "b")
    _, texts = _stream(tok, [], ids)
    n = len(char.encode())
    assert texts[0] == "a"
    # Every byte before the last of the character: nothing new is shown.
    assert texts[1:n] == ["a"] * (n - 1)
    assert texts[-2] == "a" + char and texts[-1] == "a" + char + "b"


def test_unfinished_character_is_flushed_at_the_end(tok):
    ids = _bytes_tokens(tok, "ok🙂")[:-2]          # the emoji's last two bytes never come
    d = FastIncrementalDetokenizer(tok, _request([]))
    d.update(ids, False)
    assert d.output_text == "ok"
    d.update([], False, finished=True)
    assert d.output_text == tok.decode(ids) and d.output_text.startswith("ok" + REPLACEMENT)


def test_multi_token_steps_equal_single_steps(tok):
    out = tok.encode("naïve 東京 robots 🙂 decode the stream", add_special_tokens=False)
    one, _ = _stream(tok, [1], out)
    many, _ = _stream(tok, [1], out, [3] * (len(out) // 3 + 1))
    assert one.output_text == many.output_text == tok.decode(out)


def test_special_tokens_skipped_or_kept(tok):
    out = tok.encode("Hello", add_special_tokens=False) + [3] + tok.encode(
        " world", add_special_tokens=False) + [4]
    skip, _ = _stream(tok, [], out)
    keep, _ = _stream(tok, [], out, skip_special_tokens=False)
    assert skip.output_text == "Hello world"
    assert keep.output_text == "Hello<|im_start|> world<|im_end|>"


def test_detokenize_false_tracks_ids_only(tok):
    d = IncrementalDetokenizer.from_new_request(tok, _request([1], detokenize=False))
    assert type(d) is IncrementalDetokenizer
    assert d.update([5, 6], False) is None and d.output_token_ids == [5, 6]
    assert d.get_next_output_text(True, False) == ""
    no_tokenizer = IncrementalDetokenizer.from_new_request(None, _request([1]))
    assert type(no_tokenizer) is IncrementalDetokenizer


# ---------------------------------------------------------------------- SentencePiece-style
@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory) -> tuple[Tokenizer, str]:
    """A Llama-2-style tokenizer: Metaspace ("▁" for spaces), byte fallback tokens <0xXX>,
    and a decoder that strips the leading space of a sequence."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    from kvserve.model.demo import _corpus

    base = HFTok(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never",
                                                  split=False)
    base.train_from_iterator(_corpus(600), trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    spec = json.loads(base.to_str())
    vocab = dict(spec["model"]["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
              for m in spec["model"]["merges"]]
    sp = HFTok(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    sp.add_special_tokens(["<unk>", "<s>", "</s>"])
    sp.normalizer = base.normalizer
    sp.pre_tokenizer = base.pre_tokenizer
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    path = tmp_path_factory.mktemp("sp")
    sp.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    return Tokenizer.from_pretrained(str(path)), str(path)


def test_sentencepiece_style_keeps_the_leading_space(sp_tokenizer):
    """Decoded alone, "▁world" loses its space; after the prompt it must keep it. The text
    equals decode(prompt + output) minus decode(prompt), here and in transformers."""
    from transformers import PreTrainedTokenizerFast

    sp, path = sp_tokenizer
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    rng = random.Random(3)
    pool = list("abcdefg hij") + ["é", "東", "京", "🙂", "ß", "  ", "\n", "zq"]
    byte_fallback_seen = False
    for _ in range(300):
        prompt_text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 10)))
        out_text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 25)))
        prompt = sp.encode(prompt_text, add_special_tokens=False)
        out = sp.encode(out_text, add_special_tokens=False)
        byte_fallback_seen |= any(t.startswith("<0x") for t in sp.convert_ids_to_tokens(out))
        chunks = [rng.randrange(1, 3) for _ in range(len(out))]
        d, texts = _stream(sp, prompt, out, chunks)
        full, head = hf.decode(prompt + out), hf.decode(prompt)
        assert full.startswith(head)
        assert d.output_text == full[len(head):] == sp.decode(prompt + out)[len(head):]
        assert d.output_text.startswith(" ") == out_text.startswith(" ") or out_text[0] != " "
        assert not any(t.endswith(REPLACEMENT) for t in texts)
    assert byte_fallback_seen
    # Without a prompt, the first token's space is stripped as in a one-shot decode.
    out = sp.encode(" world", add_special_tokens=False)
    d, _ = _stream(sp, [], out)
    assert d.output_text == sp.decode(out) == hf.decode(out)


def test_byte_fallback_invalid_run_does_not_break_the_stream(sp_tokenizer):
    """ByteFallback decodes a run of byte tokens that is not valid UTF-8 as one U+FFFD per
    byte, even bytes that were valid alone: "X" (0x58) followed by a stray continuation byte
    (0x87). The stream has already shown "X" and keeps it (tokenizers' DecodeStream raises
    "Invalid prefix" here; the detokenizer restarts it and goes on)."""
    sp, _ = sp_tokenizer
    ids = (sp.encode("it", add_special_tokens=False)
           + [sp.token_to_id("<0x58>"), sp.token_to_id("<0x87>")]
           + sp.encode("x", add_special_tokens=False))
    d, texts = _stream(sp, [], ids)
    assert sp.decode(ids) == "it\ufffd\ufffd x"
    assert d.output_text == "itX\ufffd x"
    assert "itX" in texts


# ---------------------------------------------------------------------- stop strings
def test_check_stop_strings_basics():
    assert check_stop_strings("hello world", 5, ["world"], False) == ("world", 6)
    assert check_stop_strings("hello world", 5, ["world"], True) == ("world", 11)
    assert check_stop_strings("hello world", 5, ["xyz"], False) is None
    assert check_stop_strings("hello world", 0, ["world"], False) is None
    # Stop string straddling old and new text: found.
    assert check_stop_strings("hello world", 4, ["o wo"], False) == ("o wo", 4)
    assert check_stop_strings("hello world", 3, ["o wo"], False) is None
    # Entirely inside text that was already searched: not found again.
    assert check_stop_strings("hello world", 3, ["hello"], False) is None
    # Include in output: cut right after the stop string, dropping what followed it.
    assert check_stop_strings("a STOP b", 8, ["STOP"], True) == ("STOP", 6)


def test_check_stop_strings_first_completed_match_wins():
    # "cd" ends before "abcdef" does: a token-by-token stream would have stopped there.
    assert check_stop_strings("xxabcdefg", 9, ["abcdef", "cd"], False) == ("cd", 4)
    # Same end: the longer (earlier-starting) one.
    assert check_stop_strings("xxabcd", 6, ["cd", "bcd"], False) == ("bcd", 3)
    # Order in the list does not matter.
    assert check_stop_strings("xxabcdefg", 9, ["cd", "abcdef"], False) == ("cd", 4)
    # Two occurrences of one string: the first in the new region.
    assert check_stop_strings("ab--ab--ab", 6, ["ab"], False) == ("ab", 4)


def test_check_stop_strings_chunking_invariant():
    rng = random.Random(11)
    stops = ["ab", "bca", "cab", "aaa"]
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 30)))
        whole = check_stop_strings(text, len(text), stops, False)
        found, pos = None, 0
        while pos < len(text) and found is None:
            step = rng.randrange(1, 5)
            pos = min(len(text), pos + step)
            found = check_stop_strings(text[:pos], min(step, pos), stops, False)
        assert found == whole, text


def test_detokenizer_truncates_at_stop_string(tok):
    out = tok.encode(" the river and the ocean", add_special_tokens=False)
    for include in (False, True):
        d = FastIncrementalDetokenizer(tok, _request([1], stop=["and the"],
                                                     include_stop_str_in_output=include))
        found = None
        for i, t in enumerate(out):
            found = d.update([t], False)
            if found:
                break
        assert found == "and the"
        assert d.output_text == (" the river and the" if include else " the river ")


def test_stop_string_hold_back_in_streamed_text(tok):
    """While running, the last len(stop)-1 characters are held back, so a stream never shows
    "STO" of a "STOP" that the next token completes and truncation removes."""
    d = FastIncrementalDetokenizer(tok, _request([1], stop=["STOP"]))
    ids = tok.encode(" go STOP", add_special_tokens=False)
    shown = ""
    for t in ids:
        stop = d.update([t], False)
        shown += d.get_next_output_text(finished=stop is not None, delta=True)
        assert "S" not in shown
        if stop:
            break
    assert stop == "STOP" and shown == d.output_text == " go "
    # Without stop strings nothing is held back.
    d = FastIncrementalDetokenizer(tok, _request([1]))
    d.update(ids, False)
    assert d.get_next_output_text(finished=False, delta=False) == " go STOP"


def test_min_tokens_ignores_stop_strings_in_the_first_tokens(tok):
    ids = tok.encode(" stop here stop", add_special_tokens=False)
    first_stop_tokens = len(tok.encode(" stop", add_special_tokens=False))
    d = FastIncrementalDetokenizer(tok, _request([1], stop=["stop"], min_tokens=first_stop_tokens))
    assert d.update(ids, False) == "stop"
    assert d.output_text == " stop here "


def test_stop_terminated_token_text_left_out(tok):
    ids = tok.encode(" hello", add_special_tokens=False) + [2]
    d = FastIncrementalDetokenizer(tok, _request([1], skip_special_tokens=False))
    d.update(ids, stop_terminated=True, finished=True)
    assert d.output_text == " hello" and d.output_token_ids == ids
    d = FastIncrementalDetokenizer(tok, _request([1], skip_special_tokens=False,
                                                 include_stop_str_in_output=True))
    d.update(ids, stop_terminated=True, finished=True)
    assert d.output_text == " hello</s>"
