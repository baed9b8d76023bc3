"""Fused CPU ops (kvserve.ops.fused): each C++ kernel against its torch reference.

float32: the kernel follows the torch code's arithmetic; only summation order (RMSNorm's sum
of squares) and exp's last bit differ, so it must agree to ~1e-6 of the output's scale.
bfloat16: the kernel keeps the torch code's bf16 rounding points, so it must agree with the
bf16 torch path to two bf16 ulps (an intermediate rounding that flips by one ulp can become two
after the next multiply), and with the float32 reference on the same (bf16) inputs to a few
bf16 ulps.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvserve.model.layers.rotary import RotaryEmbedding
from kvserve.ops import build
from kvserve.ops import fused as kf

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None
DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 3, 17, 300]
HIDDEN = [72, 100, 768]          # 72, 100: tails of the 16-lane loops
F32_TOL = 1e-6                   # relative to the output's largest magnitude
BF16_ULP = 2.0 ** -7             # one bf16 ulp, relative (8 significant bits)
BF16_VS_F32_TOL = 4 * BF16_ULP   # inputs rounded the same, a few roundings on the way


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not HAS_COMPILER:
        pytest.skip("no C++ compiler")
    if os.environ.get(build.DISABLE_ENV, "") not in ("", "0"):
        pytest.skip(f"{build.DISABLE_ENV} is set")
    kf.set_kernels_enabled(True)
    assert kf.kernels_active(), "the fused C++ kernels failed to build (see the log)"
    yield
    kf.set_kernels_enabled(True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.double().abs().max().clamp_min(1e-30)
    return ((out.double() - ref.double()).abs().max() / scale).item()


def assert_close_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float) -> None:
    """Each element within `ulps` bf16 ulps of ref (relative to the element, with a floor at
    the typical magnitude so values near zero do not demand more than the dtype holds)."""
    ref64 = ref.double()
    scale = ref64.abs().clamp_min(ref64.abs().mean().item())
    err = ((out.double() - ref64).abs() / scale).max().item()
    assert err <= ulps * BF16_ULP, f"max error {err / BF16_ULP:.2f} bf16 ulps"


def check(out: torch.Tensor, ref_same_dtype: torch.Tensor, ref_f32: torch.Tensor) -> None:
    """out vs the torch path in out's dtype, and (bf16) vs the float32 reference."""
    assert out.dtype == ref_same_dtype.dtype and out.shape == ref_same_dtype.shape
    if out.dtype == torch.float32:
        assert rel_err(out, ref_same_dtype) <= F32_TOL
    else:
        assert_close_ulps(out, ref_same_dtype, 2)
        assert_close_ulps(out, ref_f32, BF16_VS_F32_TOL / BF16_ULP)


def rand(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ------------------------------------------------------------------------------------------
# RMSNorm

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("d", HIDDEN)
def test_rms_norm(dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    for t in ROWS:
        x = rand(t, d, dtype=dtype, gen=gen, scale=3.0)
        out = kf.rms_norm(x, w, 1e-5)
        check(out, kf.rms_norm_torch(x, w, 1e-5), kf.rms_norm_torch(x.float(), w.float(), 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("d", HIDDEN)
def test_fused_add_rms_norm(dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(d + 1)
    w = (1 + 0.2 * torch.randn(d, generator=gen)).to(dtype)
    for t in ROWS:
        x, r = rand(t, d, dtype=dtype, gen=gen), rand(t, d, dtype=dtype, gen=gen, scale=4.0)
        ref_out, ref_res = kf.fused_add_rms_norm_torch(x, r, w, 1e-6)
        f32_out, f32_res = kf.fused_add_rms_norm_torch(x.float(), r.float(), w.float(), 1e-6)
        xc, rc = x.clone(), r.clone()
        out, res = kf.fused_add_rms_norm(xc, rc, w, 1e-6)
        # Sums are one rounding of an exact float32 sum, as torch's add: equal bit for bit.
        assert torch.equal(res, ref_res)
        check(out, ref_out, f32_out)
        assert out.data_ptr() == xc.data_ptr() and res.data_ptr() == rc.data_ptr()  # in place


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_rms_norm_strided_inputs(dtype: torch.dtype) -> None:
    """Qwen3's per-head norm: [T, H, D] views of a fused qkv row; and a transposed input
    (last dim not contiguous: copied first) for both norms."""
    gen = torch.Generator().manual_seed(5)
    t, h, d = 7, 6, 72
    qkv = rand(t, 2 * h * d + 40, dtype=dtype, gen=gen)
    w = rand(d, dtype=dtype, gen=gen)
    q = qkv[:, 40:40 + h * d].view(t, h, d)
    check(kf.rms_norm(q, w, 1e-6), kf.rms_norm_torch(q, w, 1e-6),
          kf.rms_norm_torch(q.float(), w.float(), 1e-6))
    x1 = qkv[2, :d]                                           # one row, 1-D
    check(kf.rms_norm(x1, w, 1e-6), kf.rms_norm_torch(x1, w, 1e-6),
          kf.rms_norm_torch(x1.float(), w.float(), 1e-6))
    xt = rand(d, t, dtype=dtype, gen=gen).t()
    rt = rand(d, t, dtype=dtype, gen=gen).t()
    check(kf.rms_norm(xt, w, 1e-6), kf.rms_norm_torch(xt, w, 1e-6),
          kf.rms_norm_torch(xt.float(), w.float(), 1e-6))
    ref_out, ref_res = kf.fused_add_rms_norm_torch(xt, rt, w, 1e-6)
    xs = torch.empty(d, t, dtype=dtype).t().copy_(xt)       # last dim strided: copied in C++
    rs = torch.empty(t, d + 5, dtype=dtype)[:, :d].copy_(rt)  # rows strided: used in place
    out, res = kf.fused_add_rms_norm(xs, rs, w, 1e-6)
    assert torch.equal(res, ref_res)
    check(out, ref_out, kf.fused_add_rms_norm_torch(xt.float(), rt.float(), w.float(), 1e-6)[0])


def test_norm_errors() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.kvserve.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual must match"):
        torch.ops.kvserve.fused_add_rms_norm(x, torch.randn(2, 8), torch.ones(8), 1e-6)


# ------------------------------------------------------------------------------------------
# Rotary embedding

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("head_size,hq,hk,scaling", [
    (64, 4, 4, None), (128, 8, 2, None), (72, 6, 2, LLAMA3_SCALING), (100, 3, 1, None),
], ids=["d64-mha", "d128-gqa", "d72-gqa-llama3", "d100-mqa"])
def test_rotary_embedding(dtype: torch.dtype, head_size: int, hq: int, hk: int,
                          scaling: dict | None) -> None:
    rope = RotaryEmbedding(head_size, 2048, 500000.0 if scaling else 10000.0, scaling)
    gen = torch.Generator().manual_seed(head_size)
    q_size, kv_size = hq * head_size, hk * head_size
    for t in ROWS:
        positions = torch.randint(0, 2048, (t,), generator=gen)
        positions[0] = 2047                                  # the table's last row
        # As in the model: q and k are column slices of one fused qkv output (strided rows).
        qkv = rand(t, q_size + 2 * kv_size, dtype=dtype, gen=gen, scale=2.0)
        q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
        args = (head_size, rope.cos_cache, rope.sin_cache)
        ref_q, ref_k = kf.rotary_embedding_torch(positions, q, k, *args)
        f32_q, f32_k = kf.rotary_embedding_torch(positions, q.float(), k.float(), *args)
        v_before = qkv[:, q_size + kv_size:].clone()
        out_q, out_k = kf.rotary_embedding(positions, q, k, *args)
        check(out_q, ref_q, f32_q)
        check(out_k, ref_k, f32_k)
        assert torch.equal(qkv[:, q_size + kv_size:], v_before)   # v untouched
        assert out_q.data_ptr() == qkv.data_ptr()                  # rotated in place


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_rotary_module_and_3d_heads(dtype: torch.dtype) -> None:
    """RotaryEmbedding.forward with the kernel vs the torch path, on [T, H, D] inputs."""
    rope = RotaryEmbedding(64, 512, 10000.0)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 512, (17,), generator=gen)
    q, k = rand(17, 4, 64, dtype=dtype, gen=gen), rand(17, 2, 64, dtype=dtype, gen=gen)
    ref_q, ref_k = kf.rotary_embedding_torch(positions, q, k, 64, rope.cos_cache, rope.sin_cache)
    out_q, out_k = rope(positions, q.clone(), k.clone())
    check(out_q, ref_q, ref_q.float())
    check(out_k, ref_k, ref_k.float())


def test_rotary_errors() -> None:
    rope = RotaryEmbedding(64, 16, 10000.0)
    q, k = torch.randn(2, 128), torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        torch.ops.kvserve.rotary_embedding(torch.tensor([0, 16]), q, k, 64, rope.cos_cache,
                                           rope.sin_cache)
    with pytest.raises(RuntimeError, match="not a multiple of head_size"):
        torch.ops.kvserve.rotary_embedding(torch.tensor([0, 1]), torch.randn(2, 100), k, 64,
                                           rope.cos_cache, rope.sin_cache)


# ------------------------------------------------------------------------------------------
# SiLU and multiply

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("inter", [72, 100, 2048])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    for t in ROWS:
        x = rand(t, 2 * inter, dtype=dtype, gen=gen, scale=4.0)
        x[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 30.0, 100.0, 88.5])   # exp's range ends
        out = kf.silu_and_mul(x)
        check(out, kf.silu_and_mul_torch(x), kf.silu_and_mul_torch(x.float()))


def test_silu_and_mul_strided_and_3d() -> None:
    gen = torch.Generator().manual_seed(11)
    x = rand(5, 300, dtype=torch.float32, gen=gen)[:, 50:250]          # strided rows
    assert rel_err(kf.silu_and_mul(x), kf.silu_and_mul_torch(x)) <= F32_TOL
    x3 = rand(2, 3, 200, dtype=torch.bfloat16, gen=gen)
    assert torch.equal(kf.silu_and_mul(x3), kf.silu_and_mul_torch(x3))


# ------------------------------------------------------------------------------------------
# KV-cache write

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("hkv,d", [(2, 64), (3, 72)])
def test_reshape_and_cache(dtype: torch.dtype, hkv: int, d: int) -> None:
    gen = torch.Generator().manual_seed(hkv * d)
    num_blocks, block_size = 40, 16
    for t in ROWS:
        cache = rand(2, num_blocks, block_size, hkv, d, dtype=dtype, gen=gen)
        ref = cache.clone()
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
        # k contiguous, v a strided slice of a fused qkv output (as in the model).
        k = rand(t, hkv, d, dtype=dtype, gen=gen)
        v = rand(t, hkv * d * 3, dtype=dtype, gen=gen)[:, hkv * d:2 * hkv * d].view(t, hkv, d)
        kf.reshape_and_cache(k, v, cache, slots)
        kf.reshape_and_cache_torch(k, v, ref, slots)
        assert torch.equal(cache, ref)


def test_reshape_and_cache_casts_and_checks_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 4, 16, 2, 8, dtype=torch.bfloat16)
    ref = cache.clone()
    k, v = rand(3, 2, 8, dtype=torch.float32, gen=gen), rand(3, 2, 8, dtype=torch.float32, gen=gen)
    slots = torch.tensor([5, 63, 17])
    kf.reshape_and_cache(k, v, cache, slots)
    kf.reshape_and_cache_torch(k, v, ref, slots)
    assert torch.equal(cache, ref)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        kf.reshape_and_cache(k, v, cache, torch.tensor([1, 2, 64]))
    assert torch.equal(cache, before)             # nothing written when a slot is bad


# ------------------------------------------------------------------------------------------
# Fallbacks

def run_all_ops(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    rope = RotaryEmbedding(64, 128, 10000.0)
    x, r, w = (rand(9, 100, dtype=dtype, gen=gen), rand(9, 100, dtype=dtype, gen=gen),
               rand(100, dtype=dtype, gen=gen))
    q, k = rand(9, 4 * 64, dtype=dtype, gen=gen), rand(9, 2 * 64, dtype=dtype, gen=gen)
    positions = torch.randint(0, 128, (9,), generator=gen)
    cache = torch.zeros(2, 2, 16, 2, 64, dtype=dtype)
    kf.reshape_and_cache(k.view(9, 2, 64), q[:, :128].view(9, 2, 64), cache,
                         torch.randperm(32, generator=gen)[:9])
    return [kf.rms_norm(x, w, 1e-6), *kf.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6),
            *kf.rotary_embedding(positions, q.clone(), k.clone(), 64, rope.cos_cache,
                                 rope.sin_cache),
            kf.silu_and_mul(torch.cat([x, r], dim=-1)), cache]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_fallback_switch_matches_kernels(dtype: torch.dtype) -> None:
    with_kernels = run_all_ops(dtype)
    kf.set_kernels_enabled(False)
    try:
        assert not kf.kernels_active()
        without = run_all_ops(dtype)
    finally:
        kf.set_kernels_enabled(True)
    for a, b in zip(with_kernels, without):
        if dtype == torch.float32:
            assert rel_err(a, b) <= F32_TOL
        else:
            assert_close_ulps(a, b, 2)


def test_env_var_disables_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.DISABLE_ENV, "1")
    kf.set_kernels_enabled(True)                 # re-reads the environment
    try:
        assert not kf.kernels_active()
        x, w = torch.randn(3, 100), torch.randn(100)
        assert torch.equal(kf.rms_norm(x, w, 1e-6), kf.rms_norm_torch(x, w, 1e-6))
    finally:
        monkeypatch.delenv(build.DISABLE_ENV)
        kf.set_kernels_enabled(True)
    assert kf.kernels_active()


def test_other_dtypes_use_torch() -> None:
    """float64 / float16 are not kernel dtypes: the torch path, same results as *_torch."""
    for dtype in (torch.float64, torch.float16):
        x, r, w = torch.randn(3, 40, dtype=dtype), torch.randn(3, 40, dtype=dtype), torch.randn(40, dtype=dtype)
        assert torch.equal(kf.rms_norm(x, w, 1e-6), kf.rms_norm_torch(x, w, 1e-6))
        out, res = kf.fused_add_rms_norm(x, r, w, 1e-6)
        ref_out, ref_res = kf.fused_add_rms_norm_torch(x, r, w, 1e-6)
        assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
        assert torch.equal(kf.silu_and_mul(x), kf.silu_and_mul_torch(x))
    # Mixed dtypes (float32 weight on bf16 activations): torch's promotion, not the kernel.
    x, w = torch.randn(3, 40, dtype=torch.bfloat16), torch.randn(40)
    out = kf.rms_norm(x, w, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, kf.rms_norm_torch(x, w, 1e-6))
