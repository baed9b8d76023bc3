"""Weights kept in the small-batch kernel's tiled layout (ops.linear.tile_weight): bf16 / fp16
with float32 math (dtype "auto" without bf16 instructions; 16-column blocks), the plain copy kept
beside a prepacked float32 weight (16-column blocks, every vector tier), and the plain copy kept
beside a prepacked bf16 weight with bf16 math (dpbf16 on avx512_bf16; 32-column blocks). The
kernel's result is bit-identical to the plain layout's for every batch size, and so is a whole
model's -- small steps (the kernel, the fused decode op), large ones (the untiled float32 copy
or the prepacked one), a tied LM head (tiled too: the embedding looks its rows up in the
tiles). tests/ops/test_cpu_isa.py runs the kernel part on every tier the host supports."""
from __future__ import annotations

import os
import shutil
from typing import Callable

import pytest
import torch

from kvserve.ops import build, cpu_isa
from kvserve.ops import cpu_weight as cw
from kvserve.ops import linear as kl
from tests.model.test_model import (Seq, blocks_for, kv_caches, load, model_config,
                                    random_tokens, run_step, shuffled_blocks)

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get(build.DISABLE_ENV, "") not in ("", "0"), reason="no C++ kernels")


def tiling_expected() -> bool:
    """The kernel has the layout on every tier with the avx2 path (all but generic)."""
    return cpu_isa.selected_tier() != "generic"


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "f32"])
@pytest.mark.parametrize("n,k", [(8, 32), (52, 96), (36, 768), (12, 2048)])
def test_tiled_kernel_matches_plain(n: int, k: int, w_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(w_dtype)
    bias = torch.randn(n, generator=gen)
    tiled = kl.tile_weight(w)
    if not tiling_expected():
        assert tiled is None
        pytest.skip("generic tier: no tiled layout")
    assert tiled is not None and tiled.shape == (n // 4, k // 16, 4, 16)
    assert tiled.dtype == w_dtype and torch.equal(kl.untile_weight(tiled), w)
    assert torch.equal(kl.untile_weight(tiled, torch.float32), w.float())
    op = kl.cpu_kernel()
    for m in range(1, 12):      # every x-row chunk size, one and two chunks
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(op(x, tiled, bias), op(x, w, bias)), m
    # ops.linear takes it at every batch size: the kernel up to 8 rows, then widened_linear.
    for m in (1, 8, 9, 40):
        x = torch.randn(2, m, k, generator=gen)
        out = kl.linear(x, tiled, bias)
        assert out.shape == (2, m, n)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w.float(), bias),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n,k", [(8, 32), (52, 96), (36, 768), (12, 2048)])
def test_tiled_bf16_math_kernel_matches_plain(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    tiled = kl.tile_weight(w, torch.bfloat16)
    if cpu_isa.selected_tier() != "avx512_bf16":
        assert tiled is None
        pytest.skip("no dpbf16 below avx512_bf16: no tiled layout for bf16 math")
    assert tiled is not None and tiled.shape == (n // 4, k // 32, 4, 32)
    assert torch.equal(kl.untile_weight(tiled), w)
    assert kl.kernel_takes(torch.bfloat16, tiled, bias)
    assert not kl.kernel_takes(torch.float32, tiled, None)     # 32-column blocks: bf16 x only
    op = kl.cpu_kernel()
    for m in range(1, 12):
        x = torch.randn(m, k, generator=gen).bfloat16()
        assert torch.equal(op(x, tiled, bias), op(x, w, bias)), m
    with pytest.raises(RuntimeError, match="tiled weight must be"):
        op(torch.randn(2, k, generator=gen), tiled, None)
    for m in (1, 8, 9, 40):     # the kernel up to 8 rows, then F.linear on the untiled weight
        x = torch.randn(m, k, generator=gen).bfloat16()
        torch.testing.assert_close(kl.linear(x, tiled, bias).float(),
                                   torch.nn.functional.linear(x, w, bias).float(),
                                   rtol=2e-2, atol=2e-2)


def test_tile_weight_declines() -> None:
    assert kl.tile_weight(torch.randn(8, 32), torch.bfloat16) is None      # float32, bf16 x
    assert kl.tile_weight(torch.randn(6, 32)) is None                      # float32, N % 4
    assert kl.tile_weight(torch.randn(8, 40)) is None                      # float32, K % 16
    assert kl.tile_weight(torch.randn(8, 32).half(), torch.bfloat16) is None  # fp16, bf16 x
    assert kl.tile_weight(torch.randn(6, 32).bfloat16()) is None           # N % 4
    assert kl.tile_weight(torch.randn(8, 40).bfloat16()) is None           # K % 16
    assert kl.tile_weight(torch.randn(8, 48).bfloat16(), torch.bfloat16) is None  # K % 32
    assert kl.tile_weight(torch.randn(8, 32).bfloat16(), torch.float16) is None   # no such x


@pytest.mark.parametrize("float32_copy", [False, True], ids=["widen-per-call", "float32-copy"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("save_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tiled_model_is_bit_identical(tied: bool, float32_copy: bool, save_dtype: torch.dtype,
                                      make_checkpoint: Callable[..., str]) -> None:
    path = make_checkpoint("llama", save_dtype=save_dtype, tie_word_embeddings=tied)
    if model_config(path, "auto").weight_dtype is None:
        pytest.skip("this tier has bf16 math: auto runs bf16, nothing is widened")
    tiled, cfg = load(path, "auto", cw.WeightPlan(cw.WIDENED, float32_copy, tiled=True))
    plain, _ = load(path, "auto", cw.WeightPlan(cw.WIDENED, float32_copy, tiled=False))
    assert tiled.lm_head.linear_weight.variant == cw.WIDENED
    assert all(w.dim() == (4 if tiling_expected() else 2) for w in layer_weights(tiled))
    assert tiled.lm_head.weight.dim() == (4 if tiling_expected() else 2)
    assert (tiled.model.embed_tokens.weight is tiled.lm_head.weight) == tied
    assert plain.model.layers[0].self_attn.qkv_proj.weight.dim() == 2
    check_same_steps(tiled, plain, cfg, torch.float32)


def layer_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    layer = model.model.layers[0]
    return [layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]


def check_same_steps(tiled: torch.nn.Module, plain: torch.nn.Module, cfg,
                     cache_dtype: torch.dtype) -> None:
    """Both models give bit-identical logits over large, mixed, batch-2 and batch-1 steps."""
    pool = shuffled_blocks(2)
    a, b = (Seq(random_tokens(30, 40 + i, cfg.vocab_size), blocks_for(30, pool))
            for i in range(2))
    schedule = [([], [(a, 0, 12)]),               # 12 tokens: a large batch
                ([(a, 12)], [(b, 0, 5)]),         # 6 tokens: the kernel / fused op
                ([(a, 13), (b, 5)], []),          # batch-2 decode
                ([(b, 6)], [])]                   # batch-1 decode
    caches_t = kv_caches(cfg, cache_dtype)
    caches_p = kv_caches(cfg, cache_dtype)
    for step, (decodes, prefills) in enumerate(schedule):
        out_t = run_step(tiled, caches_t, decodes=decodes, prefills=prefills)
        out_p = run_step(plain, caches_p, decodes=decodes, prefills=prefills)
        assert torch.equal(out_t, out_p), (step, (out_t - out_p).abs().max().item())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_tiled_copy_model_is_bit_identical(dtype: torch.dtype, tied: bool,
                                           make_checkpoint: Callable[..., str]) -> None:
    """dtype float32 (every vector tier; 16-column blocks) or bfloat16 with bf16 math (dpbf16 on
    avx512_bf16; 32-column blocks): the plain copy kept beside each prepacked weight
    (prepacked+copy) is tiled, and every step matches the plain copy's."""
    tiles = tiling_expected() if dtype == torch.float32 else cpu_isa.selected_tier() == "avx512_bf16"
    if not tiles or kl.pack_weight(torch.zeros(8, 8)) is None:
        pytest.skip(f"no tiled {dtype} copy on this tier, or no oneDNN packing")
    path = make_checkpoint("llama", save_dtype=dtype, tie_word_embeddings=tied)
    name = str(dtype).removeprefix("torch.")
    tiled, cfg = load(path, name, cw.WeightPlan(cw.PREPACKED_WITH_COPY, tiled=True))
    plain, _ = load(path, name, cw.WeightPlan(cw.PREPACKED_WITH_COPY, tiled=False))
    assert all(w.dim() == 4 and w.dtype == dtype and w.shape[3] == kl.TILE_COLS[dtype]
               for w in layer_weights(tiled))
    assert tiled.lm_head.weight.dim() == 4
    assert (tiled.model.embed_tokens.weight is tiled.lm_head.weight) == tied
    assert plain.model.layers[0].self_attn.qkv_proj.weight.dim() == 2
    check_same_steps(tiled, plain, cfg, dtype)
