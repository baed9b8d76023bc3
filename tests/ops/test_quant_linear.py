"""GGUF weights kept packed (kvserve/ops/quant, csrc/quant_linear.cpp): repacking and
dequantization against gguf's own dequantizer (exact), the activations' int8 blocks against
their reference (exact), and the integer kernels of the selected ISA tier and the portable path
against a float64 reference on the same quantized blocks.

Tolerance of the kernels: |y - ref| <= 1e-5 * (|x_q| @ |W|^T), per element. ref is float64 math
on gguf's dequantized weights and the same int8 activation blocks, so the only difference is the
kernel's float32 rounding of per-block terms (about K / 32 roundings of 6e-8 each); a wrong
scale, nibble or bit is off by far more than that. The float paths (large batches, no kernel)
use unquantized x: against x @ W^T in float64 with 1e-5 of |x| @ |W|^T.

The test data: gguf's quantizers (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) on random normal weights, and
for every type random bytes with bounded float16 scales (any such byte pattern is a valid
block; the K-quants have no Python quantizer). test_other_tier reruns the kernel tests with
KVSERVE_CPU_ISA=generic (the portable build) where the host runs more.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvserve.ops import build, cpu_isa
from kvserve.ops.quant import FORMATS, PACKED_TYPES, ROW_GROUP, PackedQuantWeight, block_format
from kvserve.ops.quant import kernel, packing, weight as qweight
from kvserve.ops.quant.reference import dequantize_gguf, quantize_activations, reference_matmul
from tests.utils import kernel_isa_prefix

HAS_KERNELS = (shutil.which(os.environ.get("CXX", "c++")) is not None and cpu_isa.is_x86_64()
               and os.environ.get(build.DISABLE_ENV, "") in ("", "0"))
needs_kernel = pytest.mark.skipif(not HAS_KERNELS, reason="no C++ kernels here")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5
GGUF_QUANTIZERS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# (N, K): N odd and below / between multiples of the 4-row interleave; K block multiples only.
SHAPES_32 = [(1, 32), (5, 64), (37, 576), (64, 1536)]
SHAPES_256 = [(1, 256), (7, 512), (37, 1536)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 33]   # 33: the op's GEMM on the VNNI build (AVX2: 64+)


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(a.astype(np.float16).tobytes(), np.uint8).reshape(*a.shape, 2)


# Byte offsets of a block's float16 fields (scale, then minimum / dmin) where not just (0,).
FP16_FIELDS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "Q2_K": (80, 82), "Q3_K": (108,)}


def random_blocks(name: str, n: int, k: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """[N, row_bytes] uint8 of any GGUF block type: random bytes with finite float16 scales
    (and minimums) of either sign, up to `scale`. (IQ1_S / IQ1_M keep their scales elsewhere.)"""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // size, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS.get(name, (0,)):
        raw[..., at:at + 2] = _f16_bytes(rng.uniform(-scale, scale, size=raw.shape[:2]))
    return raw.reshape(n, -1)


def quantized_blocks(name: str, n: int, k: int, seed: int) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return quants.quantize(w, GGMLQuantizationType[name])


def make_raw(name: str, n: int, k: int, seed: int = 0, source: str = "random") -> np.ndarray:
    if source == "gguf":
        return quantized_blocks(name, n, k, seed)
    return random_blocks(name, n, k, seed)


def cases() -> list:
    out = []
    for name in PACKED_TYPES:
        shapes = SHAPES_256 if FORMATS[name].block_size == 256 else SHAPES_32
        sources = ["random", "gguf"] if name in GGUF_QUANTIZERS else ["random"]
        out += [pytest.param(name, s, src, id=f"{name}-{s[0]}x{s[1]}-{src}")
                for s in shapes for src in sources]
    return out


def activations(m: int, k: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed + 1000).standard_normal((m, k)).astype(np.float32)
    x[:, ::7] *= 8.0       # uneven magnitudes across blocks
    return x


def check_close(y: torch.Tensor, ref: np.ndarray, bound: np.ndarray, what: str) -> None:
    y64 = y.double().numpy()
    assert y64.shape == ref.shape, (y64.shape, ref.shape)
    assert np.isfinite(y64).all(), f"{what}: non-finite outputs"
    err = np.abs(y64 - ref) - TOL * bound - 1e-30
    assert (err <= 0).all(), \
        f"{what}: max error {np.max(np.abs(y64 - ref) / (bound + 1e-30)):.3g} of |x_q||W| > {TOL}"


def poison_padding(w: PackedQuantWeight) -> None:
    """Every byte of the padding rows 0xFF: float16 scales of NaN."""
    pad_from = w.shape[0] % ROW_GROUP
    if pad_from:
        last = packing.unpack_blocks(w.packed[-1:], ROW_GROUP, w.fmt)   # [8, row_bytes]
        last[pad_from:] = 0xFF
        w.packed[-1:] = packing.pack_blocks(last, w.fmt)


def poisoned_weight(name: str, shape: tuple[int, int],
                    source: str = "random") -> tuple[np.ndarray, PackedQuantWeight]:
    """A weight's raw blocks and its packed form with the padding poisoned."""
    raw = make_raw(name, *shape, source=source)
    w = PackedQuantWeight.from_gguf(name, raw, shape)
    poison_padding(w)
    return raw, w


def nan_framed_x(m: int, k: int) -> torch.Tensor:
    """activations(m, k) as the first rows of a NaN-filled buffer: a read past x shows."""
    buf = torch.full((m + 3, k), float("nan"))
    buf[:m] = torch.from_numpy(activations(m, k, seed=m))
    return buf[:m]


@pytest.fixture(scope="module")
def ops():
    if not HAS_KERNELS:
        pytest.skip("no C++ kernels here")
    o = kernel.ops()
    assert o is not None, "the packed GGUF kernel failed to build (see the log)"
    return o


# ------------------------------------------------------------------ formats and repacking

def test_formats_match_gguf() -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, fmt in FORMATS.items():
        t = GGMLQuantizationType[name]
        assert (fmt.ggml_type, fmt.block_size, fmt.type_size) == (int(t), *GGML_QUANT_SIZES[t])
        assert block_format(t) is fmt and block_format(int(t)) is fmt
        assert block_format(name.lower()) is fmt
    with pytest.raises(ValueError, match="not kept packed"):
        block_format("IQ2_XS")
    with pytest.raises(ValueError, match="not a whole number"):
        FORMATS["Q4_K"].check_k(576)


@pytest.mark.parametrize("name,shape,source", cases())
def test_repack_and_dequantize_match_gguf_exactly(name: str, shape: tuple[int, int],
                                                  source: str) -> None:
    """Packing keeps every block's bytes; the C++ dequantizer (when built) and the torch one
    (any device, the embedding gather) give gguf.quants.dequantize's float32 bits."""
    n, k = shape
    raw = make_raw(name, n, k, source=source)
    w = PackedQuantWeight.from_gguf(name, raw, shape)
    fmt = FORMATS[name]
    groups = -(-n // ROW_GROUP)
    assert w.packed.shape == (groups, k // fmt.block_size, fmt.group_block_bytes)
    assert w.nbytes == groups * k // fmt.block_size * fmt.group_block_bytes
    decoded_scales = 32 if name in ("Q3_K", "Q4_K", "Q5_K") else 0
    assert fmt.group_block_bytes == ROW_GROUP * fmt.type_size + decoded_scales
    assert torch.equal(w.raw_rows(), torch.from_numpy(raw))
    ref = torch.from_numpy(dequantize_gguf(raw, fmt, shape))
    ids = torch.arange(n)
    assert torch.equal(w.dequantize_rows(ids), ref)
    gathered = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(w.dequantize_rows(gathered), ref[gathered])   # C++ rows where built
    blocks = packing.unpack_rows(w.packed, gathered, fmt)              # the torch path
    assert torch.equal(packing.dequantize_blocks(blocks, fmt).reshape(4, k), ref[gathered])
    if HAS_KERNELS:
        assert torch.equal(w.dequantize(), ref)
        assert torch.equal(w.dequantize(n // 3, n), ref[n // 3:])
        o, r0, r1 = kernel.ops(), min(3, n), max(min(3, n), n - 1)   # cut inside groups of 8
        assert torch.equal(o.dequantize_generic(w.packed, fmt.ggml_type, n, r0, n), ref[r0:])
        assert torch.equal(o.dequantize(w.packed, fmt.ggml_type, n, r0, r1), ref[r0:r1])


def test_bad_inputs_are_clear_errors() -> None:
    raw = make_raw("Q4_0", 6, 64)
    with pytest.raises(ValueError, match="needs 216 bytes"):
        PackedQuantWeight.from_gguf("Q4_0", raw[:5], (6, 64))
    with pytest.raises(ValueError, match="not a whole number"):
        PackedQuantWeight.from_gguf("Q4_K", np.zeros((2, 144), np.uint8), (2, 288))
    w = PackedQuantWeight.from_gguf("Q4_0", raw, (6, 64))
    with pytest.raises(ValueError, match="features"):
        w.matmul(torch.zeros(1, 32))
    with pytest.raises(IndexError):
        w.dequantize_rows(torch.tensor([6]))


# ------------------------------------------------------------------ activations

@needs_kernel
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K"])
def test_activation_blocks_match_reference_exactly(ops, name: str) -> None:
    """The kernel's int8 blocks, scales and sums are the reference's (llama.cpp's Q8_0, Q8_1;
    the K-quants' 32-blocks with float32 scales and sums of 16), bit for bit (the float64
    reference of the kernels relies on it). Zero blocks, ties and a negative largest value
    included."""
    fmt = FORMATS[name]
    x = activations(5, 1536, seed=3)
    x[1, :256] = 0.0
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5     # many exact halves
    x[3, :8] = [127.0, 0.5, 1.5, -0.5, -2.5, 63.5, -127.0, 3.0]
    x[4, 256:512] *= 0.01
    x[4, 300] = -50.0                                         # the block's largest is negative
    q, d, s, sd = ops.quantize_x(torch.from_numpy(x), fmt.ggml_type)
    ref = quantize_activations(x, fmt)
    assert np.array_equal(q.numpy(), ref.q)
    assert np.array_equal(d.numpy(), ref.d)
    assert np.array_equal(s.numpy(), ref.sums)
    assert np.array_equal(sd.numpy(), ref.sd)
    assert d.shape == (5, 1536 // 32) and q[4, 300] == -127
    if fmt.k_quant:     # float32 scales (not float16), sums of each 16
        assert s.shape == (5, 1536 // 16) and d[0, 0] == np.float32(np.abs(x[0, :32]).max()) / 127
        assert not np.array_equal(d.numpy(), d.numpy().astype(np.float16).astype(np.float32))
    else:
        assert np.array_equal(d.numpy(), d.numpy().astype(np.float16).astype(np.float32))


# ------------------------------------------------------------------ kernels

@needs_kernel
def test_kernel_built_for_the_selected_tier() -> None:
    isa = kernel.isa()
    assert isa is not None and isa.startswith(kernel_isa_prefix()), isa


@needs_kernel
@pytest.mark.parametrize("name,shape,source", cases())
def test_kernel_matches_float64_reference(ops, name: str, shape: tuple[int, int],
                                          source: str) -> None:
    """The tier's int8 path (ops.linear) and the portable one (linear_generic) at M = 1..8 and
    13 (passes of 4 x rows and a remainder), with the padding rows poisoned with NaN scales and
    x a slice of a NaN-filled buffer; matmul's choice (int8 up to INT8_MAX_ROWS, then the int8
    GEMM on the K-quants where built, else the dequantized float path) too."""
    n, k = shape
    raw, w = poisoned_weight(name, shape, source)
    fmt = FORMATS[name]
    for m in ROWS:
        x = nan_framed_x(m, k)
        ref, bound = reference_matmul(x.numpy(), raw, fmt, shape)
        check_close(ops.linear(x, w.packed, fmt.ggml_type, n), ref, bound, f"tier path M={m}")
        check_close(ops.linear_generic(x, w.packed, fmt.ggml_type, n), ref, bound,
                    f"portable path M={m}")
        if m <= qweight.INT8_MAX_ROWS or qweight.prompt_gemm_ops(fmt, x) is not None:
            check_close(w.matmul(x), ref, bound, f"matmul M={m}")   # int8: kernel or GEMM
        else:                       # prefill-sized: the float path, x unquantized
            check_close(w.matmul(x), *float_reference(x.numpy(), raw, name, shape),
                        f"matmul M={m}")
            with qweight.decode_step(True):     # decode rows only: the int8 kernel still
                assert torch.equal(w.matmul(x), ops.linear(x, w.packed, fmt.ggml_type, n))


def float_reference(x: np.ndarray, raw: np.ndarray, name: str,
                    shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    wf = dequantize_gguf(raw, FORMATS[name], shape).astype(np.float64)
    x64 = x.astype(np.float64)
    return x64 @ wf.T, np.abs(x64) @ np.abs(wf).T


@needs_kernel
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q6_K"])
def test_precise_matmul_is_float_accurate(ops, name: str) -> None:
    """matmul(precise=True) (the LM head): x's int8 blocks plus its residual's, against the
    unquantized x @ W^T in float64: within 5e-5 of |x| @ |W|^T, where the plain int8 path is
    off by more (so the residual is what makes it)."""
    shape = (37, 512)
    raw = make_raw(name, *shape)
    w = PackedQuantWeight.from_gguf(name, raw, shape)
    x = activations(3, shape[1], seed=7)
    ref, bound = float_reference(x, raw, name, shape)
    xt = torch.from_numpy(x)
    check_close(w.matmul(xt, precise=True), ref, bound / TOL * 5e-5, "precise")
    plain = np.abs(w.matmul(xt).double().numpy() - ref) / bound
    assert plain.max() > 5e-5, plain.max()


def chunked_weight(name: str, monkeypatch: pytest.MonkeyPatch
                   ) -> tuple[tuple[int, int], np.ndarray, PackedQuantWeight]:
    """A (37, 512) weight of `name` with its padding poisoned, INT8_MAX_ROWS lowered to 8 and
    CHUNK_ELEMS to 8 rows: the large-batch path, in several chunks."""
    monkeypatch.setattr(qweight, "CHUNK_ELEMS", 8 * 512)
    monkeypatch.setattr(qweight, "INT8_MAX_ROWS", 8)
    shape = (37, 512)
    raw = make_raw(name, *shape)
    w = PackedQuantWeight.from_gguf(name, raw, shape)
    poison_padding(w)
    return shape, raw, w


@pytest.mark.parametrize("name", PACKED_TYPES)
@pytest.mark.parametrize("m", [9, 33])
def test_large_batches_dequantize_into_a_float_gemm(name: str, m: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The float path (above INT8_MAX_ROWS, lowered here to 8; no int8 GEMM: INT8_GEMM off):
    float32 chunks of the weight (several: CHUNK_ELEMS is lowered too) into torch's GEMM, x
    unquantized; padding poisoned."""
    monkeypatch.setattr(qweight, "INT8_GEMM", False)
    shape, raw, w = chunked_weight(name, monkeypatch)
    x = activations(m, shape[1], seed=m)
    ref, bound = float_reference(x, raw, name, shape)
    check_close(w.matmul(torch.from_numpy(x).view(1, m, -1)).view(m, -1), ref, bound, "large M")


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_1", "Q5_K", "Q6_K"])
def test_bf16_x_is_widened_and_y_rounded_inside_the_kernel(ops, name: str) -> None:
    """bfloat16 x (a bf16 model's decode step): the kernel's own widening and rounding give the
    bits of x.float() -> the float32 kernel -> .to(bfloat16), at 1 and 8 rows."""
    shape = (37, 512)
    w = PackedQuantWeight.from_gguf(name, make_raw(name, *shape), shape)
    for m in (1, 8):
        xb = torch.from_numpy(activations(m, shape[1], seed=m)).bfloat16()
        got = ops.linear(xb, w.packed, w.fmt.ggml_type, shape[0])
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, ops.linear(xb.float(), w.packed, w.fmt.ggml_type,
                                           shape[0]).bfloat16())
        assert torch.equal(w.matmul(xb), got)


def test_precise_logits_of_bf16_x_stay_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM head (precise) of a bf16 model: float32 logits, and above INT8_MAX_ROWS (prompt
    logprobs) float32 GEMMs on the bf16 x's values: within the float path's tolerance of
    float64, where a bf16 GEMM is off by far more."""
    monkeypatch.setattr(qweight, "INT8_MAX_ROWS", 8)
    shape = (37, 512)
    raw = make_raw("Q6_K", *shape)
    w = PackedQuantWeight.from_gguf("Q6_K", raw, shape)
    xb = torch.from_numpy(activations(20, shape[1], seed=9)).bfloat16()
    ref, bound = float_reference(xb.float().numpy(), raw, "Q6_K", shape)
    y = w.matmul(xb, precise=True)
    assert y.dtype == torch.float32 and w.matmul(xb[:3], precise=True).dtype == torch.float32
    check_close(y, ref, bound, "precise, large M")
    plain = np.abs(w.matmul(xb).double().numpy() - ref) / bound
    assert plain.max() > TOL, plain.max()


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_large_batches_of_bf16_x_run_bf16_gemms(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 x above INT8_MAX_ROWS (a prompt of a bf16 model) where no int8 GEMM takes it
    (INT8_GEMM off here; Q6_K and the legacy types always): the weight's chunks rounded to
    bf16 for bf16 GEMMs, the result bf16. Against float64 on the same rounded inputs: within the
    bf16 output's rounding (2^-8 of |y|) plus 1e-5 of |x||W|; padding poisoned."""
    monkeypatch.setattr(qweight, "INT8_GEMM", False)
    shape, raw, w = chunked_weight(name, monkeypatch)
    xb = torch.from_numpy(activations(33, shape[1], seed=5)).bfloat16()
    wb = torch.from_numpy(dequantize_gguf(raw, FORMATS[name], shape)).bfloat16()
    x64, w64 = xb.double().numpy(), wb.double().numpy()
    ref, bound = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    y = w.matmul(xb)
    assert y.dtype == torch.bfloat16 and y.shape == (33, shape[0])
    err = np.abs(y.double().numpy() - ref) - 2.0 ** -8 * np.abs(ref) - TOL * bound
    assert (err <= 0).all(), np.abs(y.double().numpy() - ref).max()


# Each type's stored weight values in its GGUF block (bytes [lo, hi)), which the limit test sets
# to their largest magnitude (0x80: Q8_0's -128; 0xFF: the others' unsigned maximum, 15 .. 63).
QUANT_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24),
               "Q8_0": (2, 34), "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192),
               "IQ4_NL": (2, 18), "Q3_K": (0, 96), "Q2_K": (16, 80)}
# The stored byte of the largest weights: Q8_0's -128, IQ4_NL's nibbles 0 (-127); others 0xFF
# (Q3_K: hmask and qs all ones, every q + 4 at 7).
LIMIT_BYTE = {"Q8_0": 0x80, "IQ4_NL": 0x00}


@needs_kernel
@pytest.mark.parametrize("name", PACKED_TYPES)
def test_int16_sums_at_their_limit_stay_exact(ops, name: str) -> None:
    """Every weight at its largest stored value and every x value at +-127 (rows of +1 and -1):
    the AVX2 paths sum maddubs's int16 pairs over as many 4-value units as stay under 2^15
    (the small-batch kernel's kFlush, the GEMM's GemmType::kI16), so these inputs reach that
    limit; the kernel and the GEMM stay within the float64 tolerance."""
    n, k = 40, 512
    fmt = FORMATS[name]
    raw = random_blocks(name, n, k, seed=5).reshape(n, k // fmt.block_size, fmt.type_size)
    lo, hi = QUANT_BYTES[name]
    raw[..., lo:hi] = LIMIT_BYTE.get(name, 0xFF)
    raw = raw.reshape(n, -1)
    w = PackedQuantWeight.from_gguf(name, raw, (n, k))
    x = torch.ones(70, k)
    x[1::2] = -1.0
    q, _, _, _ = ops.quantize_x(x[:2].contiguous(), fmt.ggml_type)
    assert (q[0] == 127).all() and (q[1] == -127).all()
    for m in (1, 4, 13, 70):
        ref, bound = reference_matmul(x[:m].numpy(), raw, fmt, (n, k))
        check_close(ops.linear(x[:m].contiguous(), w.packed, fmt.ggml_type, n), ref, bound,
                    f"kernel M={m}")
        if ops.gemm_supports(fmt.ggml_type):
            check_close(ops.gemm(x[:m].contiguous(), w.packed, fmt.ggml_type, n), ref, bound,
                        f"gemm M={m}")


# The types the AVX2 builds have no int8 GEMM for (VNNI's has one for every type): their
# prompts and decode batches take the float path / the small-batch kernel there.
NO_AVX2_GEMM = ("Q8_0", "IQ4_NL", "Q2_K")
# N odd, a group short of a 16-row panel, and past a 32-row work item.
GEMM_SHAPES = {32: [(1, 32), (37, 576), (70, 1536)], 256: [(1, 256), (37, 512), (70, 1536)]}
GEMM_ROWS = [1, 2, 3, 4, 5, 7, 9, 33]       # the 4-row microkernel and every remainder


def gemm_cases() -> list:
    return [pytest.param(name, shape, id=f"{name}-{shape[0]}x{shape[1]}") for name in PACKED_TYPES
            for shape in GEMM_SHAPES[FORMATS[name].block_size]]


def needs_gemm(ops, name: str) -> None:
    if not ops.gemm_supports(FORMATS[name].ggml_type):
        pytest.skip(f"no int8 GEMM for {name} in this build ({kernel.isa()})")


@needs_kernel
def test_int8_gemm_only_where_the_build_has_it(ops) -> None:
    """The avx512_bf16 tier's VNNI build has the GEMM for every packed type, the AVX2
    builds (avx2, avx512) not for Q8_0 and IQ4_NL (maddubs would saturate on their values)
    and Q2_K (slower there than the small-batch kernel), the portable build for none (matmul
    keeps the float path there); the op says so where it has none."""
    isa = kernel.isa()
    missing = (set(PACKED_TYPES) if isa.startswith("generic") else
               set() if isa.startswith("avx512 vnni") else set(NO_AVX2_GEMM))
    assert {t for t in PACKED_TYPES if not ops.gemm_supports(FORMATS[t].ggml_type)} == missing
    for name in missing:
        w = PackedQuantWeight.from_gguf(name, make_raw(name, 8, 256), (8, 256))
        with pytest.raises(RuntimeError, match="no int8 GEMM for GGML type"):
            ops.gemm(torch.zeros(2, 256), w.packed, w.fmt.ggml_type, 8)


@needs_kernel
@pytest.mark.parametrize("name,shape", gemm_cases())
def test_int8_gemm_matches_float64_reference(ops, name: str, shape: tuple[int, int]) -> None:
    """The prompt GEMM (csrc/quant_gemm.h) on float32 x against the float64 reference on the same
    int8 blocks (the kernels' tolerance), and on bfloat16 x (y bf16) against it on x's bf16
    values within y's rounding, 2^-8 of |y|, too; x a slice of a NaN-filled buffer, the padding
    rows' scales NaN."""
    needs_gemm(ops, name)
    n, k = shape
    raw, w = poisoned_weight(name, shape)
    fmt = FORMATS[name]
    for m in GEMM_ROWS:
        x = nan_framed_x(m, k)
        ref, bound = reference_matmul(x.numpy(), raw, fmt, shape)
        check_close(ops.gemm(x, w.packed, fmt.ggml_type, n), ref, bound, f"gemm M={m}")
        xb = x.bfloat16()
        yb = ops.gemm(xb, w.packed, fmt.ggml_type, n)
        assert yb.dtype == torch.bfloat16
        ref, bound = reference_matmul(xb.float().numpy(), raw, fmt, shape)
        err = np.abs(yb.double().numpy() - ref) - 2.0 ** -8 * np.abs(ref) - TOL * bound
        assert (err <= 0).all(), f"bf16 M={m}: {np.abs(yb.double().numpy() - ref).max()}"


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_K", "Q2_K"])
def test_prompts_and_decode_batches_take_the_int8_gemm(ops, name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GEMM runs (INT8_MAX_ROWS lowered to 8): bf16 and float32 prompt rows on a
    K-quant (Q2_K: where the build has it, VNNI) take it (same bits as ops.gemm), on a legacy
    type the chunks in x's dtype; the LM head (precise) float32 GEMMs; in a decode-only step
    the int8 op hands gemm_min_rows() rows (16 with VNNI, 64 on AVX2) to the GEMM (same bits)
    and the LM head keeps its residual rows."""
    needs_gemm(ops, name)
    shape, raw, w = chunked_weight(name, monkeypatch)
    n, qt = shape[0], w.fmt.ggml_type
    x = activations(20, shape[1], seed=3)
    xb, xf = torch.from_numpy(x).bfloat16(), torch.from_numpy(x)
    assert torch.equal(w.matmul(xb), ops.gemm(xb, w.packed, qt, n))
    assert torch.equal(w.matmul(xf), ops.gemm(xf, w.packed, qt, n))
    check_close(w.matmul(xb, precise=True),
                *float_reference(xb.float().numpy(), raw, name, shape), "precise")
    legacy = PackedQuantWeight.from_gguf("Q4_1", make_raw("Q4_1", *shape), shape)
    assert torch.equal(legacy.matmul(xb), legacy.dequantized_matmul(xb))
    assert torch.equal(legacy.matmul(xf), legacy.dequantized_matmul(xf))
    rows = ops.gemm_min_rows()
    assert rows in (16, 64) and rows <= qweight.INT8_DECODE_MAX_ROWS
    xd = torch.from_numpy(activations(rows, shape[1], seed=4))
    with qweight.decode_step(True):
        assert torch.equal(w.matmul(xd), ops.gemm(xd, w.packed, qt, n))
        assert torch.equal(w.matmul(xd.bfloat16()), ops.gemm(xd.bfloat16(), w.packed, qt, n))
        assert torch.equal(legacy.matmul(xd), ops.gemm(xd, legacy.packed, legacy.fmt.ggml_type, n))
        precise = w.matmul(xf, precise=True)
    ref, bound = float_reference(x, raw, name, shape)    # the residual row's 5e-5, as above
    check_close(precise, ref, bound / TOL * 5e-5, "precise, decode")
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        ops.gemm(xb, w.packed, 99, shape[0])


@pytest.mark.parametrize("m", [1, 8, 12])
def test_without_kernels_the_torch_path_is_correct(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """No C++ kernel (another CPU, no compiler, disabled): torch dequantization + float GEMM,
    bias and bfloat16 x included."""
    monkeypatch.setattr(kernel, "ops", lambda: None)
    shape = (37, 512)
    raw = make_raw("Q5_K", *shape)
    w = PackedQuantWeight.from_gguf("Q5_K", raw, shape)
    x = activations(m, shape[1], seed=m)
    bias = torch.randn(shape[0])
    ref, bound = float_reference(x, raw, "Q5_K", shape)
    check_close(w.matmul(torch.from_numpy(x), bias) - bias, ref, bound, "torch path")
    yb = w.matmul(torch.from_numpy(x).bfloat16())
    assert yb.dtype == torch.bfloat16 and yb.shape == (m, shape[0])


# ------------------------------------------------------------------ tensor parallelism

@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
@pytest.mark.parametrize("world", [2, 4])
def test_shards_recombine_to_the_whole(name: str, world: int) -> None:
    """Column-parallel shards (dim 0) concatenate, row-parallel ones (dim 1) sum, to the whole
    weight's product."""
    k = 256 * world
    shape = (8 * world, k)
    raw = make_raw(name, *shape)
    w = PackedQuantWeight.from_gguf(name, raw, shape)
    xn = activations(qweight.INT8_MAX_ROWS or 8, k, seed=1)
    x = torch.from_numpy(xn)
    # The int8 kernel where built (shards cut on x's int8 blocks too, so the same blocks).
    ref, bound = (reference_matmul(xn, raw, FORMATS[name], shape) if kernel.ops() is not None
                  else float_reference(xn, raw, name, shape))
    cols = torch.cat([w.shard(0, r, world).matmul(x) for r in range(world)], dim=1)
    check_close(cols, ref, bound, "column-parallel shards")
    parts = [w.shard(1, r, world) for r in range(world)]
    assert all(p.shape == (shape[0], k // world) for p in parts)
    rows = sum(p.matmul(x[:, r * (k // world):(r + 1) * (k // world)])
               for r, p in enumerate(parts))
    check_close(rows, ref, bound, "row-parallel shards")
    assert torch.equal(torch.cat([p.dequantize_rows(torch.arange(shape[0])) for p in parts], 1),
                       w.dequantize_rows(torch.arange(shape[0])))


def test_shards_off_block_boundaries_are_errors() -> None:
    w = PackedQuantWeight.from_gguf("Q4_K", make_raw("Q4_K", 6, 512), (6, 512))
    with pytest.raises(ValueError, match="not whole 256-weight blocks"):
        w.shard(1, 0, 4)            # 128 input features a shard
    with pytest.raises(ValueError, match="does not split into 4"):
        w.shard(0, 0, 4)            # 6 rows
    with pytest.raises(ValueError, match="rank 2 outside"):
        w.shard(0, 2, 2)


# ------------------------------------------------------------------ the real demo model

@needs_kernel
def test_demo_model_tensors(ops, smollm2_gguf: str) -> None:
    """SmolLM2-135M-Instruct's own blocks: a Q4_1 attention and MLP weight and the Q8_0
    embedding, as GGUFReader gives them."""
    from gguf import GGUFReader

    reader = GGUFReader(smollm2_gguf)
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        shape = (int(t.shape[1]), int(t.shape[0]))           # GGUF lists K first
        w = PackedQuantWeight.from_gguf(t.tensor_type, t.data, shape)
        fmt = block_format(t.tensor_type)
        ids = torch.tensor([0, 1, shape[0] - 1, 17])
        ref_rows = dequantize_gguf(np.asarray(t.data)[ids.numpy()], fmt, (4, shape[1]))
        assert torch.equal(w.dequantize_rows(ids), torch.from_numpy(ref_rows))
        if name == "token_embd.weight":
            continue                                          # 113 MB as float64: rows only
        x = activations(3, shape[1], seed=5) * 0.1
        ref, bound = reference_matmul(x, np.asarray(t.data), fmt, shape)
        check_close(w.matmul(torch.from_numpy(x)), ref, bound, name)


def _kernel_outputs(path: str) -> None:
    """Every packed type's int8 kernel at M = 1, 3, 4, 13 on fixed random blocks, and its int8
    GEMM at M = 6, 13, x float32 and bf16 (every type but those with none on AVX2), saved."""
    out, ops = {}, kernel.ops()
    for name in PACKED_TYPES:
        n, k = 40, 512
        w = PackedQuantWeight.from_gguf(name, make_raw(name, n, k, seed=3), (n, k))
        x = torch.from_numpy(activations(13, k, seed=3))
        for m in (1, 3, 4, 13):
            out[f"{name} M={m}"] = ops.linear(x[:m].contiguous(), w.packed, w.fmt.ggml_type, n)
        for m in (6, 13) if name not in NO_AVX2_GEMM else ():
            out[f"{name} gemm M={m}"] = ops.gemm(x[:m].contiguous(), w.packed, w.fmt.ggml_type, n)
            out[f"{name} gemm bf16 M={m}"] = ops.gemm(x[:m].bfloat16(), w.packed,
                                                      w.fmt.ggml_type, n)
    torch.save(out, path)


@needs_kernel
@pytest.mark.timeout(600)
@pytest.mark.skipif(not cpu_isa.is_x86_64() or "avx512_vnni" not in cpu_isa.cpu_flags()
                    or cpu_isa.selected_tier() != "avx512_bf16",
                    reason="the VNNI build needs the avx512_bf16 tier (AVX-512 VNNI)")
def test_vnni_path_gives_the_avx2_bits(tmp_path) -> None:
    """vpdpbusd (int32 sums of 4 products) and maddubs + madd (int16 pair sums) are both exact
    integer sums here, so the VNNI build must give the AVX2 build's bits for every type, in
    the small-batch kernel and in the GEMM's two microkernels."""
    assert "vnni" in (kernel.isa() or "")
    _kernel_outputs(str(tmp_path / "vnni.pt"))
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from tests.ops.test_quant_linear "
            f"import _kernel_outputs; _kernel_outputs({str(tmp_path / 'avx2.pt')!r})")
    env = dict(os.environ, **{cpu_isa.ISA_ENV: "avx2"})
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-3000:]
    vnni, avx2 = torch.load(tmp_path / "vnni.pt"), torch.load(tmp_path / "avx2.pt")
    assert vnni.keys() == avx2.keys()
    for key in vnni:
        assert torch.isfinite(vnni[key]).all(), key
        assert torch.equal(vnni[key], avx2[key]), key


# ------------------------------------------------------------------ the other tier

OTHER_TIERS = [t for t in cpu_isa.supported_tiers() if t != cpu_isa.selected_tier()][:1] \
    if cpu_isa.is_x86_64() and not os.environ.get(cpu_isa.ISA_ENV) else []


@pytest.mark.timeout(900)
@needs_kernel
@pytest.mark.parametrize("tier", [t for t in OTHER_TIERS if t == "generic"] or [
    pytest.param(None, marks=pytest.mark.skip(reason="the host runs only one tier, or "
                                                      "KVSERVE_CPU_ISA is set"))])
def test_other_tier(tier: str) -> None:
    """The kernel tests once more on the portable build (KVSERVE_CPU_ISA=generic)."""
    env = dict(os.environ, **{cpu_isa.ISA_ENV: tier})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "kernel or activation or large_batches"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
