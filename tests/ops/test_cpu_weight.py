"""The CPU weight object (kvserve.ops.cpu_weight): the one policy that picks a model's weight
variant (choose_weight_plan: dtype, ISA tier, the small-batch kernel, oneDNN packing, memory
budget), each variant's matmul / streamed weight / rows against torch, and the loader giving
every weight of a model one plan (a tied LM head and its embedding one object)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from kvserve.ops import cpu_weight as cw
from kvserve.ops import linear as kl
from tests.model.test_model import load

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
MIB = 1 << 20


def plan(weight_dtype: torch.dtype, act_dtype: torch.dtype, tier: str = "avx2",
         kernel: bool = True, packing: bool = True, numel: int = MIB, tied_numel: int = 0,
         budget: int = 1 << 40, device: str = "cpu") -> cw.WeightPlan:
    return cw.choose_weight_plan(weight_dtype, act_dtype, device=device, tier=tier,
                                 kernel=kernel, packing=packing, numel=numel,
                                 tied_numel=tied_numel, budget=budget)


@pytest.mark.parametrize("tier,variant", [
    ("generic", cw.PREPACKED), ("avx2", cw.PREPACKED_WITH_COPY),
    ("avx512", cw.PREPACKED_WITH_COPY), ("avx512_bf16", cw.PREPACKED_WITH_COPY)])
def test_float32_weights_keep_the_copy_on_vector_tiers(tier: str, variant: str) -> None:
    assert plan(F32, F32, tier) == cw.WeightPlan(variant)


@pytest.mark.parametrize("tier,variant", [
    ("generic", cw.PREPACKED), ("avx2", cw.PREPACKED), ("avx512", cw.PREPACKED),
    ("avx512_bf16", cw.PREPACKED_WITH_COPY)])
def test_bf16_math_keeps_the_copy_only_with_dpbf16(tier: str, variant: str) -> None:
    assert plan(BF16, BF16, tier).variant == variant


def test_no_copy_without_the_kernel_or_over_budget() -> None:
    assert plan(F32, F32, kernel=False).variant == cw.PREPACKED
    # The copy costs numel * 4 bytes; a tied LM head's share costs nothing (the embedding
    # keeps its plain weight anyway).
    assert plan(F32, F32, numel=MIB, budget=4 * MIB).variant == cw.PREPACKED_WITH_COPY
    assert plan(F32, F32, numel=MIB, budget=4 * MIB - 1).variant == cw.PREPACKED
    assert plan(F32, F32, numel=2 * MIB, tied_numel=MIB,
                budget=4 * MIB).variant == cw.PREPACKED_WITH_COPY


def test_plain_without_packing_and_on_cuda() -> None:
    assert plan(F32, F32, packing=False) == cw.WeightPlan(cw.PLAIN)
    assert plan(F16, F16, packing=False) == cw.WeightPlan(cw.PLAIN)
    assert plan(BF16, BF16, device="cuda") == cw.WeightPlan(cw.PLAIN)
    assert plan(BF16, F32, device="cuda") == cw.WeightPlan(cw.PLAIN)


@pytest.mark.parametrize("w_dtype", [BF16, F16])
def test_16bit_weights_with_float32_math_are_widened(w_dtype: torch.dtype) -> None:
    # The float32 copy costs numel * 4 bytes (all matmul weights, a tied head's too).
    assert plan(w_dtype, F32, numel=MIB, budget=4 * MIB) == cw.WeightPlan(cw.WIDENED, True)
    assert plan(w_dtype, F32, numel=MIB, tied_numel=MIB,
                budget=4 * MIB - 1) == cw.WeightPlan(cw.WIDENED, False)
    assert plan(w_dtype, F32, packing=False) == cw.WeightPlan(cw.WIDENED, False)
    assert plan(w_dtype, F32, tier="generic", kernel=False).variant == cw.WIDENED


def test_unknown_variant_is_an_error() -> None:
    with pytest.raises(ValueError, match="weight variant must be one of"):
        cw.WeightPlan("tiled")


VARIANT_PLANS = [cw.WeightPlan(cw.PLAIN), cw.WeightPlan(cw.PREPACKED),
                 cw.WeightPlan(cw.PREPACKED_WITH_COPY),
                 cw.WeightPlan(cw.PREPACKED_WITH_COPY, tiled=False)]


@pytest.mark.parametrize("p", VARIANT_PLANS, ids=lambda p: f"{p.variant}-tiled{p.tiled}")
def test_each_variant_computes_the_linear_and_its_rows(p: cw.WeightPlan) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen)
    b = torch.randn(48, generator=gen)
    param = torch.nn.Parameter(w.clone(), requires_grad=False)
    obj = cw.make_weight(param, p, F32, keep_plain=True)
    if kl.pack_weight(torch.zeros(8, 8)) is None:
        assert obj.variant == cw.PLAIN      # nothing to prepack with: plain
    else:
        assert obj.variant == p.variant
    for m in (1, 8, 9, 40):
        x = torch.randn(m, 64, generator=gen)
        torch.testing.assert_close(obj.matmul(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    ids = torch.tensor([0, 5, 47, 5])
    assert torch.equal(obj.rows(ids), w[ids])       # kept plain (a tied embedding reads it)
    streamed = obj.streamed()
    assert (streamed is None) == (obj.variant == cw.PREPACKED)
    if streamed is not None:     # only a copy beside a prepacked weight is tiled
        tiles = obj.variant == cw.PREPACKED_WITH_COPY and p.tiled and kl.tile_weight(w) is not None
        assert streamed.dim() == (4 if tiles else 2)


def test_widened_weight_streams_16bit_and_returns_float32() -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 64, generator=gen).bfloat16()
    param = torch.nn.Parameter(w.clone(), requires_grad=False)
    obj = cw.make_weight(param, cw.WeightPlan(cw.WIDENED, float32_copy=True), F32)
    assert obj.variant == cw.WIDENED and obj.streamed().dtype == BF16
    for m in (1, 40):
        x = torch.randn(m, 64, generator=gen)
        out = obj.matmul(x)
        assert out.dtype == F32
        torch.testing.assert_close(out, F.linear(x, w.float()), rtol=1e-5, atol=1e-4)
    assert torch.equal(obj.rows(torch.tensor([3])), w[[3]])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_loader_gives_every_weight_one_plan(tied: bool,
                                            make_checkpoint: Callable[..., str]) -> None:
    model, _ = load(make_checkpoint("llama", tie_word_embeddings=tied))
    layer = model.model.layers[0]
    objs = [layer.self_attn.qkv_proj.linear_weight, layer.self_attn.o_proj.linear_weight,
            layer.mlp.gate_up_proj.linear_weight, layer.mlp.down_proj.linear_weight,
            model.lm_head.linear_weight]
    assert len({o.variant for o in objs}) == 1
    embed = model.model.embed_tokens.linear_weight
    assert (embed is model.lm_head.linear_weight) == tied
    if not tied:
        assert embed.variant == cw.PLAIN
