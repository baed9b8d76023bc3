"""Prepacked linear weights that also keep their plain layout for small batches
(ops.linear.keep_small_batch_copies; the default for float32 on every vector tier and for
bfloat16 on avx512_bf16, where the small-batch kernel and the fused small-step path beat
oneDNN's prepacked path up to SMALL_BATCH_MAX_ROWS rows): which path each batch
size takes, the policy, and the layers that use it. The model against transformers with and
without the copies is in tests/model/test_model.py."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvserve.model.layers.linear import ReplicatedLinear, set_small_batch_copies
from kvserve.ops import build, cpu_isa, linear as kl
from tests.ops import test_linear as tl

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get(build.DISABLE_ENV, "") not in ("", "0")
    or kl.pack_weight(torch.zeros(8, 8)) is None, reason="no C++ kernels or no oneDNN packing")

ROWS = [1, kl.SMALL_BATCH_MAX_ROWS, kl.SMALL_BATCH_MAX_ROWS + 1, 40]


def expected_path(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor,
                  b: torch.Tensor) -> torch.Tensor:
    """The kernel's result up to SMALL_BATCH_MAX_ROWS rows, the packed weight's above."""
    if x.shape[0] <= kl.SMALL_BATCH_MAX_ROWS:
        return kl.cpu_kernel()(x, w, b)
    return kl.packed_linear(x, packed, b)


@pytest.mark.parametrize("m", ROWS)
def test_small_batch_or_packed_linear_takes_the_right_path(m: int) -> None:
    # K = 300: the kernel and oneDNN sum in different orders, so their results differ in the
    # last bits and the comparison below tells the paths apart.
    x, w, b = tl.make_case(m, 300, 50, torch.float32, bias=True, seed=m)
    packed = kl.pack_weight(w)
    assert not torch.equal(kl.cpu_kernel()(x, w, b), kl.packed_linear(x, packed, b))
    out = kl.small_batch_or_packed_linear(x.view(1, m, 300), w, packed, b)
    assert out.shape == (1, m, 50)
    tl.check(out.view(m, 50), x, w, b)
    assert torch.equal(out.view(m, 50), expected_path(x, w, packed, b))


@pytest.mark.parametrize("keep", [False, True])
def test_layer_keeps_the_plain_weight_only_with_the_copy(keep: bool) -> None:
    x, w, b = tl.make_case(40, 300, 50, torch.float32, bias=True, seed=7)
    layer = ReplicatedLinear(300, 50, bias=True)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    layer.small_batch_copy = keep
    layer.process_weights_after_loading()
    assert layer.weight_packed is not None
    assert layer.weight.numel() == (w.numel() if keep else 0)
    for m in (1, kl.SMALL_BATCH_MAX_ROWS, 40):
        out = layer(x[:m])
        tl.check(out, x[:m], w, b)
        ref = (expected_path(x[:m], w, layer.weight_packed, b) if keep
               else kl.packed_linear(x[:m], layer.weight_packed, b))
        assert torch.equal(out, ref), m


def test_small_batch_copy_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kl.SMALL_BATCH_COPY_ENV, "auto")
    tier = cpu_isa.selected_tier()
    assert kl.keep_small_batch_copies(torch.float32, 1 << 20) == (tier != "generic")
    assert kl.keep_small_batch_copies(torch.bfloat16, 1 << 20) == (tier == "avx512_bf16")
    assert not kl.keep_small_batch_copies(torch.float32, 1 << 60)     # more than memory allows
    assert not kl.keep_small_batch_copies(torch.float16, 1 << 20)
    monkeypatch.setenv(kl.SMALL_BATCH_COPY_ENV, "0")
    assert not kl.keep_small_batch_copies(torch.float32, 1)
    monkeypatch.setenv(kl.SMALL_BATCH_COPY_ENV, "1")
    assert kl.keep_small_batch_copies(torch.bfloat16, 1 << 60)
    monkeypatch.setenv(kl.SMALL_BATCH_COPY_ENV, "yes")
    with pytest.raises(ValueError, match="auto, 1 or 0"):
        kl.keep_small_batch_copies(torch.float32, 1)


def test_set_small_batch_copies_decides_for_the_whole_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(ReplicatedLinear(64, 32, bias=False),
                                ReplicatedLinear(32, 16, bias=False))
    for setting, keep in (("1", True), ("0", False)):
        monkeypatch.setenv(kl.SMALL_BATCH_COPY_ENV, setting)
        set_small_batch_copies(model)
        assert [m.small_batch_copy for m in model] == [keep, keep]
