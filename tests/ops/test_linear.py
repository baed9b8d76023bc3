"""Small-batch linear: the C++ CPU kernel, the F.linear fallback and the dispatching wrapper
against F.linear computed in float64."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from kvserve.ops import cpu_isa
from kvserve.ops import linear as kl
from tests.utils import kernel_isa_prefix

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")

# float32: the kernel's summation order differs from float64's; relative to the output's scale.
# bfloat16: products are exact and sums float32, so the error is the output's rounding to bf16
# (2^-8 relative) plus float32 noise.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
ROWS = [1, 2, 3, 4, 5, 8, 9, 16]
# (in_features, out_features): the benchmark Llama's shapes, then odd K (tail) and odd N.
SHAPES = [(768, 2304), (768, 768), (768, 4096), (2048, 768), (100, 1001), (33, 7), (31, 5)]


def make_case(m: int, k: int, n: int, dtype: torch.dtype, bias: bool, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, w, b


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == x.dtype and out.shape == ref.shape
    # Per element: relative to the larger of |ref| and the typical magnitude of a dot product.
    scale = ref.abs().clamp_min(ref.abs().mean().item())
    err = ((out.double() - ref).abs() / scale).max().item()
    assert err <= TOLERANCES[x.dtype], f"max scaled error {err}"


@pytest.fixture(scope="module")
def kernel():
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    op = kl.cpu_kernel()
    assert op is not None, "the C++ kernel failed to build (see the log)"
    return op


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_matches_float64(kernel, dtype: torch.dtype, k: int, n: int) -> None:
    for m in ROWS:
        for bias in (False, True):
            x, w, b = make_case(m, k, n, dtype, bias, seed=m)
            check(kernel(x, w, b), x, w, b)


@needs_compiler
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16-widened"])
@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
def test_rows_do_not_depend_on_the_batch(kernel, w_dtype: torch.dtype, tiled: bool) -> None:
    # float32 x: every row of a 2..17-row x gets the same bits as in the 17-row one. x rows go
    # in balanced chunks, so no chunk of a multi-row x has one row (a one-row chunk of a bf16
    # weight splits its even / odd products: other bits; 9 rows as 8 + 1 did).
    x, w, _ = make_case(17, 96, 40, torch.float32, bias=False)
    w = w.to(w_dtype)
    if tiled:
        w = kl.tile_weight(w, torch.float32)
        if w is None:
            pytest.skip("no tiled layout for this weight on this tier")
    full = kernel(x, w, None)
    for m in range(2, 17):
        assert torch.equal(kernel(x[:m].contiguous(), w, None), full[:m]), m


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_lm_head_shape(kernel, dtype: torch.dtype) -> None:
    x, w, _ = make_case(1, 768, 32000, dtype, bias=False)
    check(kernel(x, w, None), x, w, None)


@needs_compiler
def test_vector_path_compiled(kernel) -> None:
    """The build took the selected tier's vector path (KVSERVE_CPU_ISA or the host's best)."""
    isa = kl.cpu_kernel_isa()
    assert isa.startswith(kernel_isa_prefix()), isa
    if cpu_isa.selected_tier() == "avx512_bf16":
        assert "dpbf16" in isa


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_wrapper_dispatch_and_shapes(kernel, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(1001, 100, generator=gen) / 10).to(dtype)
    b = torch.randn(1001, generator=gen).to(dtype)
    # Leading dims, a non-contiguous x (every other column), and more rows than the kernel takes.
    for shape in [(100,), (1, 100), (2, 3, 100), (kl.SMALL_BATCH_MAX_ROWS + 1, 100)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        out = kl.linear(x, w, b)
        assert out.shape == (*shape[:-1], 1001)
        check(out.reshape(-1, 1001), x.reshape(-1, 100), w, b)
    wide = torch.randn(3, 200, generator=gen).to(dtype)
    x = wide[:, ::2]
    assert not x.is_contiguous()
    check(kl.linear(x, w, b), x, w, b)
    # A non-contiguous weight (a transposed view) goes to F.linear and is still right.
    wt = w.t().contiguous().t()
    assert not wt.is_contiguous()
    check(kl.linear(x, wt, b), x, wt, b)


def test_empty_and_mixed_dtypes() -> None:
    w = torch.randn(7, 5)
    assert kl.linear(torch.randn(0, 5), w).shape == (0, 7)
    x = torch.randn(2, 5, dtype=torch.float64)            # not a kernel dtype: F.linear
    torch.testing.assert_close(kl.linear(x, w.double()), F.linear(x, w.double()))


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_packed_matches_float64(dtype: torch.dtype, k: int, n: int) -> None:
    """oneDNN-prepacked weights (what the model's linear layers use on CPU): every batch size,
    with and without bias, 1-D / 3-D inputs."""
    if dtype == torch.bfloat16 and not cpu_isa.has_native_bf16() and not kl._packing_works(dtype):
        # oneDNN refuses bf16 without avx512bw/vl/dq or avx_ne_convert (pack_weight -> None;
        # models then keep 16-bit weights with float32 math: tests/test_auto_dtype.py).
        pytest.skip("oneDNN has no bf16 prepacking on this CPU")
    for m in [0, 1, 3, 8, 17, 64, 300]:
        for bias in (False, True):
            x, w, b = make_case(m, k, n, dtype, bias, seed=m)
            packed = kl.pack_weight(w)
            assert packed is not None
            out = kl.packed_linear(x, packed, b)
            if m:
                check(out, x, w, b)
            else:
                assert out.shape == (0, n)
    x, w, _ = make_case(6, k, n, dtype, False)
    packed = kl.pack_weight(w)
    torch.testing.assert_close(kl.packed_linear(x.view(2, 3, k), packed),
                               kl.packed_linear(x, packed).view(2, 3, n))
    # A non-contiguous input (a slice of a wider activation) reads the right elements.
    wide = torch.cat([x, torch.randn(6, 5).to(dtype)], dim=1)
    torch.testing.assert_close(kl.packed_linear(wide[:, :k], packed), kl.packed_linear(x, packed))


def test_pack_weight_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    assert kl.pack_weight(torch.randn(4, 3, dtype=torch.float64)) is None
    assert kl.pack_weight(torch.randn(4, 3, dtype=torch.float16)) is None
    # A oneDNN without this path (the load-time self-check fails): the plain weight is kept.
    monkeypatch.setattr(kl, "_packing_works", lambda dtype: False)
    assert kl.pack_weight(torch.randn(4, 3)) is None


@pytest.mark.timeout(120)
def test_fallback_when_disabled() -> None:
    """KVSERVE_DISABLE_CPU_KERNELS=1: no build, F.linear, same results (checked in a fresh
    process, since the kernel choice is cached per process)."""
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from kvserve.ops import linear as kl
        assert kl.cpu_kernel() is None
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(3, 100).to(dtype)
            w = torch.randn(1001, 100).to(dtype)
            b = torch.randn(1001).to(dtype)
            torch.testing.assert_close(kl.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
            torch.testing.assert_close(kl.linear(x.view(1, 3, 100), w, b),
                                       F.linear(x.view(1, 3, 100), w, b), rtol=0, atol=0)
        assert kl.pack_weight(torch.randn(4, 3)) is None     # no prepacking either
        print("ok")
    """)
    env = dict(os.environ, KVSERVE_DISABLE_CPU_KERNELS="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@needs_compiler
@pytest.mark.timeout(120)
def test_coexists_with_paged_attention() -> None:
    """Both kernels register into torch.ops.kvserve; either may load first."""
    code = textwrap.dedent("""
        import torch
        from kvserve.ops import linear as kl, paged_attention as pa
        assert kl.cpu_kernel() is not None and pa.cpu_kernel() is not None
        assert torch.ops.kvserve.small_batch_linear_isa() and torch.ops.kvserve.paged_attention_isa()
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_float32_above_the_kernel_takes_onednn_on_the_plain_weight() -> None:
    """Past the kernel's rows a float32 plain weight runs oneDNN's linear (not F.linear, whose
    MKL sgemm runs generic code on AMD CPUs at under half the speed): its bits exactly."""
    if not kl.packing_works(torch.float32):
        pytest.skip("no oneDNN float32 linear")
    m = kl.small_batch_max_rows(torch.float32) + 5
    x, w, b = make_case(m, 300, 50, torch.float32, bias=True, seed=3)
    want = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    assert not torch.equal(want, F.linear(x, w, b))       # the two paths are told apart
    assert torch.equal(kl.linear(x, w, b), want)
    check(kl.linear(x, w, b), x, w, b)
