"""The CUDA path's fused Triton kernels (kvserve/ops/triton/fused.py) against float64
references; on CPU under Triton's interpreter (as tests/attention/test_triton_kernels.py).

Each kernel gives a token its own program, so a token's result must not depend on the batch:
every case also runs one token alone and compares it bit for bit with its row of the batch.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():   # before the kernels are defined (on import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
# Rounded once to the dtype from float32 math (a reference rounding at the same points is
# within one ulp): one ulp of bf16 / f16 relative, a few float32 ulps.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def ops():
    from kvserve.ops.triton import fused
    return fused


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any()
    err = (out.double().cpu() - ref).abs()
    bound = TOL[dtype] * (ref.abs() + 1.0)
    assert (err <= bound).all(), float((err / (ref.abs() + 1.0)).max())


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_fused_add_rms_norm(ops, dtype: torch.dtype) -> None:
    T, N, eps = 7, 96, 1e-5     # N not a power of two: the masked tail
    x, r = _rand(T, N, dtype=dtype, seed=1), _rand(T, N, dtype=dtype, seed=2)
    w = _rand(N, dtype=dtype, seed=3)
    s = x.double().cpu() + r.double().cpu()
    ref = w.double().cpu() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    one = ops.fused_add_rms_norm(x[3:4].clone(), r[3:4].clone(), w, eps)
    out, res = ops.fused_add_rms_norm(x.clone(), r.clone(), w, eps)
    _close(out, ref, dtype)
    _close(res, s, dtype)
    assert torch.equal(one[0][0], out[3]) and torch.equal(one[1][0], res[3])
    plain = ops.rms_norm(x, w, eps)
    xd = x.double().cpu()
    _close(plain, w.double().cpu() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps),
           dtype)
    assert torch.equal(ops.rms_norm(x[5:6], w, eps)[0], plain[5])


def _tables(max_pos: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return f.cos().to(DEVICE), f.sin().to(DEVICE)


def _rope_ref(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              d: int) -> torch.Tensor:
    xd = x.double().cpu().view(x.shape[0], -1, d)
    c, s = cos.double().cpu()[pos.cpu()][:, None], sin.double().cpu()[pos.cpu()][:, None]
    a, b = xd[..., :d // 2], xd[..., d // 2:]
    return torch.cat((a * c - b * s, b * c + a * s), -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rotary_embedding_and_cache(ops, dtype: torch.dtype) -> None:
    T, hq, hk, d, bs, nb = 6, 4, 2, 32, 16, 5
    qkv = _rand(T, (hq + 2 * hk) * d, dtype=dtype, seed=4)
    cos, sin = _tables(300, d)
    pos = torch.tensor([0, 5, 17, 299, 64, 3], device=DEVICE)
    slots = torch.tensor([70, 3, -1, 16, 79, 31], device=DEVICE)   # -1: a padding row
    q_ref = _rope_ref(qkv[:, :hq * d], pos, cos, sin, d)
    k_ref = _rope_ref(qkv[:, hq * d:(hq + hk) * d], pos, cos, sin, d)
    v = qkv[:, (hq + hk) * d:].double().cpu().view(T, hk, d)

    cache = torch.full((2, nb, bs, hk, d), float("nan"), dtype=dtype, device=DEVICE)
    work = qkv.clone()
    q, k = work[:, :hq * d], work[:, hq * d:(hq + hk) * d]   # views of one qkv, as the model's
    ops.rotary_embedding_and_cache(pos, q, k, work[:, (hq + hk) * d:], d, cos, sin, cache, slots)
    _close(q.view(T, hq, d), q_ref, dtype)
    _close(k.view(T, hk, d), k_ref, dtype)
    flat = cache.view(2, nb * bs, hk, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[0, s], k.view(T, hk, d)[t])
            _close(flat[1, s], v[t], dtype)
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [i for i in range(nb * bs) if i not in written]
    assert torch.isnan(flat[:, untouched]).all()

    # Rotary alone: the same rotation; one token alone gives its batch row bit for bit.
    q2, k2 = ops.rotary_embedding(pos, qkv[:, :hq * d].clone(), qkv[:, hq * d:(hq + hk) * d]
                                  .clone(), d, cos, sin)
    assert torch.equal(q2, q) and torch.equal(k2, k)
    q1, _ = ops.rotary_embedding(pos[3:4], qkv[3:4, :hq * d].clone(),
                                 qkv[3:4, hq * d:(hq + hk) * d].clone(), d, cos, sin)
    assert torch.equal(q1[0], q[3])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_and_mul(ops, dtype: torch.dtype) -> None:
    T, inter = 5, 1100        # two column blocks of 1024, the second masked
    x = _rand(T, 2 * inter, dtype=dtype, seed=5) * 3
    g, u = x.double().cpu()[:, :inter], x.double().cpu()[:, inter:]
    out = ops.silu_and_mul(x)
    _close(out, g / (1 + torch.exp(-g)) * u, dtype)
    assert torch.equal(ops.silu_and_mul(x[2:3])[0], out[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_and_mul_linear(ops, dtype: torch.dtype) -> None:
    """The batch-1 down projection with its activation: silu_and_mul(x) @ w.T, the activation
    rounded where silu_and_mul rounds; K not a multiple of the block (the masked tail)."""
    T, inter, N = 3, 1100, 40
    x = _rand(T, 2 * inter, dtype=dtype, seed=8)
    w = (_rand(N, inter, dtype=torch.float32, seed=9) * 0.05).to(dtype)
    act = ops.silu_and_mul(x).double().cpu()                     # checked above
    ref = act @ w.double().cpu().t()
    out = ops.silu_and_mul_linear(x, w)
    assert out.shape == (T, N) and out.dtype == dtype
    _close(out, ref, dtype)
    one = ops.silu_and_mul_linear(x[1:2], w)
    assert torch.equal(one[0], out[1])
    from kvserve.ops import fused as dispatch       # CPU tensors: not taken (the two ops)
    assert dispatch.silu_and_mul_linear(x.cpu(), w.cpu()) is None


def test_bad_inputs_are_value_errors(ops) -> None:
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm(x, torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="odd"):
        ops.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    cos, sin = _tables(8, 8)
    with pytest.raises(ValueError, match="head size|H\\*"):
        ops.rotary_embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), x,
                             torch.zeros(3, 6, device=DEVICE), 8, cos, sin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_ops_dispatch_to_triton_on_cuda() -> None:
    """kvserve.ops.fused sends CUDA tensors to these kernels: same results as the kernels."""
    from kvserve.ops import fused as dispatch
    from kvserve.ops.triton import fused as tri
    x = _rand(4, 256, dtype=torch.bfloat16, seed=6)
    w = _rand(256, dtype=torch.bfloat16, seed=7)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6), tri.rms_norm(x, w, 1e-6))
    assert torch.equal(dispatch.silu_and_mul(x), tri.silu_and_mul(x))
    down = _rand(64, 128, dtype=torch.bfloat16, seed=8)
    assert torch.equal(dispatch.silu_and_mul_linear(x[:1], down),
                       tri.silu_and_mul_linear(x[:1], down))
    assert dispatch.silu_and_mul_linear(x, down) is None      # 4 rows: cuBLAS
