"""Every C++ kernel on the selected ISA tier (the host's best, or KVSERVE_CPU_ISA's) against its
reference, a few shapes each, tails of the 8- and 16-lane loops included. The other test files
in tests/ops go deeper on the host's tier; test_cpu_isa.py runs this file (and the dtype="auto"
greedy test) once more for every other tier the host supports."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.ops import build, fused as kf, linear as kl, paged_attention as pa
from kvserve.ops import prefill_attention as pf
from kvserve.ops.cpu_weight import WidenedWeight
from tests.ops import test_linear as tl, test_paged_attention as tpa, test_prefill_attention as tpf
from tests.utils import kernel_isa_prefix

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get(build.DISABLE_ENV, "") not in ("", "0"), reason="no C++ kernels here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def fused_kernels_on():
    kf.set_kernels_enabled(True)
    assert kf.kernels_active(), "the fused C++ kernels failed to build (see the log)"


def test_every_kernel_built_for_the_selected_tier() -> None:
    for isa in (kl.cpu_kernel_isa(), pa.cpu_kernel_isa(), pf.cpu_kernel_isa(),
                kf.cpu_kernel_isa()):
        assert isa is not None and isa.startswith(kernel_isa_prefix()), isa


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_linear_float32_x_any_weight(wdtype: torch.dtype, m: int) -> None:
    """float32 activations with a 16-bit weight (dtype "auto" without bf16 math): the kernel
    widens the weight in registers; K = 100 leaves a tail of every vector width."""
    x, w, b = tl.make_case(m, 100, 37, torch.float32, bias=True, seed=m)
    w = w.to(wdtype)
    out = kl.cpu_kernel()(x, w, b)
    tl.check(out, x, w.float(), b)


@pytest.mark.parametrize("m", [1, 8, 9, 40])
def test_linear_dispatch_with_16bit_weight(m: int) -> None:
    """ops.linear: up to SMALL_BATCH_MAX_ROWS rows through the kernel, more through the float32
    GEMM on a widened copy; both in float32, never a bf16 GEMM."""
    x, w, b = tl.make_case(m, 96, 50, torch.float32, bias=True, seed=m)
    wb = w.bfloat16()
    out = kl.linear(x.view(1, m, 96), wb, b)
    assert out.dtype == torch.float32 and out.shape == (1, m, 50)
    tl.check(out.view(m, 50), x, wb.float(), b)


@pytest.mark.parametrize("m", [1, 8, 9, 40])
def test_linear_16bit_weight_with_float32_copy(m: int) -> None:
    """A 16-bit weight that also keeps a prepacked float32 copy (widened + copy): small
    batches stream the 16-bit weight, larger ones use the copy; the same float32 result."""
    x, w, b = tl.make_case(m, 96, 50, torch.float32, bias=True, seed=m)
    wb = w.bfloat16()
    packed = kl.pack_weight(wb.float())
    out = WidenedWeight(wb, torch.float32, packed).matmul(x.view(1, m, 96), b)
    assert out.dtype == torch.float32 and out.shape == (1, m, 50)
    tl.check(out.view(m, 50), x, wb.float(), b)


def test_bf16_linear_kernel() -> None:
    x, w, b = tl.make_case(5, 100, 33, torch.bfloat16, bias=True)
    tl.check(kl.cpu_kernel()(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [100, 768])
def test_fused_ops(dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(5, d, generator=gen).to(dtype)
    r = torch.randn(5, d, generator=gen).to(dtype)
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kf.rms_norm(x, w, 1e-6), kf.rms_norm_torch(x, w, 1e-6), **tol)
    ref_out, ref_res = kf.fused_add_rms_norm_torch(x, r, w, 1e-6)
    out, res = kf.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(res, ref_res, **tol)
    g = torch.randn(5, 2 * d, generator=gen).to(dtype) * 4
    torch.testing.assert_close(kf.silu_and_mul(g), kf.silu_and_mul_torch(g), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_size", [40, 64])
def test_rotary_and_cache_write(dtype: torch.dtype, head_size: int) -> None:
    gen = torch.Generator().manual_seed(head_size)
    rope = RotaryEmbedding(head_size, 64, base=10000.0)
    pos = torch.tensor([0, 5, 63])
    q = torch.randn(3, 2 * head_size, generator=gen).to(dtype)
    k = torch.randn(3, head_size, generator=gen).to(dtype)
    ref_q, ref_k = kf.rotary_embedding_torch(pos, q, k, head_size, rope.cos_cache, rope.sin_cache)
    out_q, out_k = kf.rotary_embedding(pos, q.clone(), k.clone(), head_size, rope.cos_cache,
                                       rope.sin_cache)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out_q, ref_q, **tol)
    torch.testing.assert_close(out_k, ref_k, **tol)
    cache = torch.full((2, 4, 4, 1, head_size), float("nan"), dtype=dtype)
    ref = cache.clone()
    slots = torch.tensor([3, 9, 14])
    kv = k.view(3, 1, head_size)
    kf.reshape_and_cache(kv, kv * 2, cache, slots)
    kf.reshape_and_cache_torch(kv, kv * 2, ref, slots)
    assert torch.equal(cache.isnan(), ref.isnan())
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [40, 64, 36])   # 36: no vector path, portable loops
def test_attention_kernels(dtype: torch.dtype, head_dim: int) -> None:
    tpa.check(pa.cpu_kernel(), [1, 16, 17, 40], 2, 3, head_dim, 16, dtype)
    tpf.check(pf.cpu_kernel(), [(0, 37), (20, 1), (33, 20)], 2, 2, head_dim, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_attention_split_over_threads_keeps_the_bits(dtype: torch.dtype) -> None:
    """Decode attention of long sequences split over 1, 2 and 3 threads (on the avx2 tier a
    sequence's token chunks spread over threads and fold afterwards), and one sequence alone:
    the same bits every time, and close to the reference."""
    lens = [700, 5, 300]
    q, kv_cache, tables, seq_lens = tpa.make_case(lens, 2, 3, 64, 16, dtype, seed=4)
    op = pa.cpu_kernel()
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(op(q, kv_cache, tables, seq_lens, 0.125))
            outs.append(op(q[:1], kv_cache, tables[:1], seq_lens[:1], 0.125))
    finally:
        torch.set_num_threads(threads)
    for out in outs[2::2]:
        assert torch.equal(out, outs[0])
    for alone in outs[1::2]:
        assert torch.equal(alone, outs[0][:1])
    torch.testing.assert_close(outs[0].double(),
                               tpa.reference(q, kv_cache, tables, seq_lens, 0.125),
                               **tpa.TOLERANCES[dtype])
