"""Prepacked linear weights that also keep their plain layout for small batches (the
prepacked+copy variant of ops.cpu_weight; the policy's choice for float32 on every vector tier
and for bfloat16 on avx512_bf16, where the small-batch kernel and the fused small-step path
beat oneDNN's prepacked path up to ops.linear.onednn_above_rows: 16 for float32 (6 on AVX-512),
8 for bfloat16): which path each batch size takes, in the layers that use it. The policy is
tested in tests/ops/test_cpu_weight.py, the model against transformers with and without the
copies in tests/model/test_model.py."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvserve.model.layers.linear import ReplicatedLinear
from kvserve.ops import build, cpu_weight as cw, linear as kl
from tests.ops import test_linear as tl

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get(build.DISABLE_ENV, "") not in ("", "0")
    or kl.pack_weight(torch.zeros(8, 8)) is None, reason="no C++ kernels or no oneDNN packing")

F32_MAX = kl.onednn_above_rows(torch.float32)
ROWS = sorted({1, 9, F32_MAX, F32_MAX + 1, 16, 17, 40})


def expected_path(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor,
                  b: torch.Tensor) -> torch.Tensor:
    """The kernel's result up to onednn_above_rows rows, the packed weight's above."""
    if x.shape[0] <= kl.onednn_above_rows(x.dtype):
        return kl.cpu_kernel()(x, w, b)
    return kl.packed_linear(x, packed, b)


@pytest.mark.parametrize("m", ROWS)
def test_prepacked_with_copy_takes_the_right_path(m: int) -> None:
    # K = 300: the kernel and oneDNN sum in different orders, so their results differ in the
    # last bits and the comparison below tells the paths apart.
    x, w, b = tl.make_case(m, 300, 50, torch.float32, bias=True, seed=m)
    packed = kl.pack_weight(w)
    assert not torch.equal(kl.cpu_kernel()(x, w, b), kl.packed_linear(x, packed, b))
    out = cw.PrepackedWithCopy(w, torch.float32, packed).matmul(x.view(1, m, 300), b)
    assert out.shape == (1, m, 50)
    tl.check(out.view(m, 50), x, w, b)
    assert torch.equal(out.view(m, 50), expected_path(x, w, packed, b))


@pytest.mark.parametrize("keep", [False, True])
def test_layer_keeps_the_plain_weight_only_with_the_copy(keep: bool) -> None:
    x, w, b = tl.make_case(40, 300, 50, torch.float32, bias=True, seed=7)
    layer = ReplicatedLinear(300, 50, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    variant = cw.PREPACKED_WITH_COPY if keep else cw.PREPACKED
    layer.linear_weight = cw.make_weight(layer.weight, cw.WeightPlan(variant), torch.float32)
    packed = layer.linear_weight.packed
    assert packed is not None and layer.linear_weight.variant == variant
    assert layer.weight.numel() == (w.numel() if keep else 0)
    assert (layer.linear_weight.streamed() is layer.weight) == keep
    for m in (1, F32_MAX, 40):
        out = layer(x[:m])
        tl.check(out, x[:m], w, b)
        ref = (expected_path(x[:m], w, packed, b) if keep
               else kl.packed_linear(x[:m], packed, b))
        assert torch.equal(out, ref), m


def test_the_onednn_limit_follows_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.linear.ONEDNN_ABOVE_ROWS moves the switch for this process's tier (6 rows of
    float32 on the AVX-512 tiers; forced to 4 here, whatever the tier), never past
    small_batch_max_rows; other dtypes keep theirs."""
    from kvserve.ops import cpu_isa
    monkeypatch.setitem(kl.ONEDNN_ABOVE_ROWS, (cpu_isa.selected_tier(), torch.float32), 4)
    monkeypatch.setitem(kl.ONEDNN_ABOVE_ROWS, (cpu_isa.selected_tier(), torch.bfloat16), 99)
    kl._onednn_above.cache_clear()
    try:
        assert kl.onednn_above_rows(torch.float32) == 4
        assert kl.onednn_above_rows(torch.bfloat16) == kl.small_batch_max_rows(torch.bfloat16)
        for m in (4, 5):
            x, w, b = tl.make_case(m, 300, 50, torch.float32, bias=True, seed=m)
            packed = kl.pack_weight(w)
            out = cw.PrepackedWithCopy(w, torch.float32, packed).matmul(x, b)
            path = kl.cpu_kernel()(x, w, b) if m == 4 else kl.packed_linear(x, packed, b)
            assert torch.equal(out, path), m
    finally:
        kl._onednn_above.cache_clear()
