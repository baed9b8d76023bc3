"""GGUF types rewritten at load as packed types (kvserve/ops/quant/transcode.py): the rewritten
blocks dequantize to the original blocks' weights (gguf.quants the reference) within float16's
rounding of each 32 weights' scale (2^-11, relative) for IQ4_XS -> IQ4_NL. Every byte pattern of
the quants and scales occurs in the random blocks; the float16 super-block scales are finite, as
a file's are."""
from __future__ import annotations

import numpy as np
import pytest

from kvserve.ops.quant.transcode import TRANSCODED, transcode
from tests.ops.test_quant_linear import random_blocks


def _dequantize(qtype: str, rows: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(rows, GGMLQuantizationType[qtype]), dtype=np.float64)


# Blocks of random bytes (gguf has no IQ4_XS quantizer).
CASES = [pytest.param(t, s, id=f"{t}-{s[0]}x{s[1]}")
         for t in sorted(TRANSCODED) for s in [(1, 256), (7, 512), (33, 1536)]]


@pytest.mark.parametrize("qtype, shape", CASES)
def test_rewritten_blocks_hold_the_same_weights(qtype: str, shape) -> None:
    n, k = shape
    rows = random_blocks(qtype, n, k, seed=n)
    target, out = transcode(qtype, rows)
    assert target == TRANSCODED[qtype] and out.dtype == np.uint8 and out.shape[0] == n
    want, got = _dequantize(qtype, rows), _dequantize(target, out)
    assert want.shape == got.shape == (n, k)
    # float16(d * (s - 32)): normal results within 2^-11; subnormal ones 2^-25 absolute.
    assert np.all(np.abs(got - want) <= 2.0 ** -11 * np.abs(want) + 127 * 2.0 ** -25)
    assert not np.array_equal(got, want)        # the rounding is real, so the bound is used


@pytest.mark.parametrize("qtype", sorted(TRANSCODED))
def test_rewrites_in_row_chunks_are_the_whole_tensors(qtype: str, monkeypatch) -> None:
    from kvserve.ops.quant import transcode as module

    rows = random_blocks(qtype, 11, 512, seed=5)
    whole = transcode(qtype, rows)[1]
    monkeypatch.setattr(module, "_CHUNK_BLOCKS", 7)       # 1 or 3 rows a chunk here
    assert np.array_equal(transcode(qtype, rows)[1], whole)


def test_rewritten_rows_pack_and_dequantize_as_the_file() -> None:
    """A rewritten tensor through the packed weight (ops.quant.PackedQuantWeight): its rows
    dequantize to the rewritten blocks' weights."""
    import torch

    from kvserve.ops.quant.weight import QuantizedRows

    for qtype in sorted(TRANSCODED):
        rows = random_blocks(qtype, 9, 512, seed=3)
        target, out = transcode(qtype, rows)
        weight = QuantizedRows.pack([QuantizedRows.from_file(qtype, rows, (9, 512))])
        assert weight.qtype == target
        got = weight.dequantize_rows(torch.arange(9)).double().numpy()
        assert np.array_equal(got, _dequantize(target, out))


def test_types_without_a_rewrite_are_errors() -> None:
    with pytest.raises(ValueError, match="IQ2_XS has no rewrite"):
        transcode("IQ2_XS", np.zeros((1, 74), np.uint8))
