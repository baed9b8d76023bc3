"""The CUDA path's GGUF kernels (kvserve/ops/triton/quant.py) against float64 references on
the same blocks; on CPU under Triton's interpreter (as tests/ops/test_triton_fused.py).

Every block type, on the packed layout PackedQuantWeight keeps (8 rows interleaved), with an odd
row count (13: the last group has 3 padding rows, poisoned with 0xFF bytes = NaN scales), K not
a multiple of the kernels' 256-weight tile for the 32-weight types (9 blocks), x a view of a
wider buffer whose unused columns are NaN, and outputs written into NaN-filled buffers.

- dequantize_rows equals gguf's dequantizer bit for bit (float32), for any row ids;
- the GEMV (M = 1, 3; and a K split), the tl.dot kernel (M = 11 > GEMV_MAX_ROWS) and the
  dequantize-then-matmul path (path="dequant", the default past DOT_MAX_ROWS) against
  x @ W^T in float64, W gguf's dequantized weight. Tolerance, per element, relative to
  bound = |x| @ |W|^T: float32 x 1e-5 (float32 accumulation of K products; d * q is exact in
  float32); float16 x 1e-3 and bfloat16 x 8e-3 (the output's rounding, and past the GEMV
  the weight's rounding to x's dtype: 2^-11 / 2^-8 relative). A wrong scale,
  nibble or bit is off by far more.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():   # before the kernels are defined (on import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvserve.ops.quant import FORMATS, PACKED_TYPES, ROW_GROUP, PackedQuantWeight  # noqa: E402
from kvserve.ops.quant import packing  # noqa: E402
from kvserve.ops.quant.reference import dequantize_gguf  # noqa: E402
from kvserve.ops.triton import quant as tq  # noqa: E402
from tests.ops.test_quant_linear import random_blocks  # noqa: E402

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
N = 13


def _k(name: str) -> int:
    return 512 if FORMATS[name].block_size == 256 else 9 * 32


def _weight(name: str, n: int, k: int, seed: int) -> tuple[PackedQuantWeight, np.ndarray]:
    """(packed weight on DEVICE with NaN-poisoned padding rows, gguf's float32 [n, k])."""
    fmt = FORMATS[name]
    raw = random_blocks(name, n, k, seed)
    w = PackedQuantWeight.from_gguf(name, raw, (n, k))
    pad = n % ROW_GROUP
    if pad:
        last = packing.unpack_blocks(w.packed[-1:], ROW_GROUP, fmt)
        last[pad:] = 0xFF
        w.packed[-1:] = packing.pack_blocks(last, fmt)
    return w.to(DEVICE), dequantize_gguf(raw, fmt, (n, k))


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [m, k] as a view of a [m, k + 40] buffer whose other columns are NaN."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((m, k + 40), float("nan"))
    buf[:, :k] = torch.randn(m, k, generator=g)
    buf[:, :k:7] *= 8.0
    return buf.to(dtype).to(DEVICE)[:, :k]


def _check(y: torch.Tensor, x: torch.Tensor, w: np.ndarray, dtype: torch.dtype,
           bias: "torch.Tensor | None" = None) -> None:
    x64 = x.double().cpu().numpy()
    ref = x64 @ w.astype(np.float64).T
    bound = np.abs(x64) @ np.abs(w.astype(np.float64)).T
    if bias is not None:
        ref = ref + bias.double().cpu().numpy()
        bound = bound + np.abs(bias.double().cpu().numpy())
    got = y.double().cpu().numpy()
    assert got.shape == ref.shape and np.isfinite(got).all()
    rel = np.abs(got - ref) / (bound + 1e-30)
    assert (np.abs(got - ref) <= TOL[dtype] * bound + 1e-30).all(), float(rel.max())


def _into_nan(m: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [m, n], its NaN-filled [m + 1, n + 8] buffer)."""
    buf = torch.full((m + 1, n + 8), float("nan"), dtype=dtype, device=DEVICE)
    return buf[:m, :n], buf


@pytest.mark.parametrize("name", PACKED_TYPES)
def test_every_type_dequantizes_and_multiplies(name: str) -> None:
    fmt = FORMATS[name]
    k = _k(name)
    w, ref = _weight(name, N, k, seed=fmt.ggml_type)
    ids = torch.tensor([12, 0, 5, 5, 8, 1], device=DEVICE)     # any order, repeats
    rows = tq.dequantize_rows(w.packed, fmt, N, k, ids)
    assert np.array_equal(rows.cpu().numpy(), ref[ids.cpu().numpy()])
    for m, path in ((1, None), (3, None), (11, None), (11, "dequant")):  # GEMV x2, tl.dot, dequant
        x = _x(m, k, torch.float32, seed=m)
        out, buf = _into_nan(m, N, torch.float32)
        y = tq.quant_matmul(x, w.packed, fmt, N, out=out, path=path)
        assert y.data_ptr() == out.data_ptr()
        _check(y, x, ref, torch.float32)
        assert torch.isnan(buf[m:]).all() and torch.isnan(buf[:, N:]).all()   # only out


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_16bit_activations_and_bias(name: str, dtype: torch.dtype) -> None:
    """x (and y) in a 16-bit dtype, a bias, both kernels."""
    fmt = FORMATS[name]
    k = _k(name)
    w, ref = _weight(name, N, k, seed=3)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    for m, path in ((2, None), (17, None), (17, "dequant")):
        x = _x(m, k, dtype, seed=10 + m)
        y = tq.quant_matmul(x, w.packed, fmt, N, bias=bias, path=path)
        assert y.dtype == dtype
        _check(y, x, ref, dtype, bias)


def test_gemv_split_k_and_one_row_alone() -> None:
    """K long enough that the GEMV splits it (float32 partials, summed by each row block's last
    split to finish), for several rows and for one (the M = 1 kernel accumulates a whole tile
    and reduces once); twice into NaN-filled outputs: a counter left set would skip the
    second call's merge."""
    from kvserve.ops.triton.counters import counters_at_rest
    name = "Q6_K"
    fmt, n, k = FORMATS[name], 9, 2048
    w, ref = _weight(name, n, k, seed=7)
    assert tq._gemv_config(n, k // 256)[1] == 4
    x = _x(4, k, torch.float32, seed=8)
    bias = torch.randn(n, device=DEVICE)
    for _ in range(2):
        out, _buf = _into_nan(4, n, torch.float32)
        y = tq.quant_matmul(x, w.packed, fmt, n, bias=bias, out=out)
        _check(y, x, ref, torch.float32, bias)
        one, _buf = _into_nan(1, n, torch.float32)
        tq.quant_matmul(x[2:3], w.packed, fmt, n, bias=bias, out=one)   # M = 1: its own path
        _check(one, x[2:3], ref, torch.float32, bias)
    assert counters_at_rest("packed_gemv", x.device)


def test_bad_inputs_are_value_errors() -> None:
    fmt = FORMATS["Q4_0"]
    w, _ = _weight("Q4_0", 8, 64, seed=1)
    with pytest.raises(ValueError, match="32-weight blocks"):
        tq.quant_matmul(torch.zeros(1, 48, device=DEVICE), w.packed, fmt, 8)
    with pytest.raises(ValueError, match="packed blocks"):
        tq.quant_matmul(torch.zeros(1, 64, device=DEVICE), w.packed, fmt, 16)
    with pytest.raises(ValueError, match="out must be"):
        tq.quant_matmul(torch.zeros(2, 64, device=DEVICE), w.packed, fmt, 8,
                        out=torch.empty(2, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="path 'gemv' for 9 rows"):
        tq.quant_matmul(torch.zeros(9, 64, device=DEVICE), w.packed, fmt, 8, path="gemv")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_weight_on_cuda_uses_the_kernels() -> None:
    """PackedQuantWeight on the GPU: matmul (any leading shape, bias), dequantize and
    dequantize_rows go through these kernels and agree with gguf's values."""
    for name in PACKED_TYPES:
        fmt, k = FORMATS[name], 2 * _k(name)
        w, ref = _weight(name, 45, k, seed=5)
        x = torch.randn(2, 3, k, device=DEVICE, dtype=torch.bfloat16)
        bias = torch.randn(45, device=DEVICE, dtype=torch.bfloat16)
        y = w.matmul(x, bias)
        assert y.shape == (2, 3, 45) and y.dtype == torch.bfloat16
        assert torch.equal(y.view(6, 45), tq.quant_matmul(x.view(6, k), w.packed, fmt, 45,
                                                          bias=bias))
        _check(y.view(6, 45), x.view(6, k), ref, torch.bfloat16, bias)
        assert np.array_equal(w.dequantize().cpu().numpy(), ref)
        ids = torch.tensor([44, 3], device=DEVICE)
        assert np.array_equal(w.dequantize_rows(ids).cpu().numpy(), ref[[44, 3]])
        big = torch.randn(300, k, device=DEVICE, dtype=torch.float16)
        _check(w.matmul(big), big, ref, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_stays_packed_on_cuda_and_generates_like_dequantized(tiny_llama, tmp_path,
                                                                  qtype: str) -> None:
    """A GGUF file on CUDA (CUDA graphs on): its blocks stay packed (the Triton kernels, the
    embedding too) and greedy float32 decoding equals --quantization gguf-dequantized's on
    the same file (the same weights; only the summation order differs)."""
    from kvserve import LLM, SamplingParams
    from tests.model.gguf_files import write_gguf

    path = write_gguf(tiny_llama, str(tmp_path / f"tiny-{qtype}.gguf"), qtype)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = ["Hello, my name is", "The capital of France is"]
    outs = []
    for quant in ("gguf", "gguf-dequantized"):
        with LLM(path, dtype="float32", device="cuda", max_model_len=256,
                 multiprocessing=False, quantization=quant) as llm:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-3 for k in x.keys() & y.keys())
