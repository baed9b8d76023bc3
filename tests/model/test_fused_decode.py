"""The fused decode path (all decoder layers of a small decode step in one C++ call,
kvserve.model.layers.fused_decode) against the layer-by-layer path: bit-identical logits and
KV caches, for every architecture switch it handles and every dtype mode. Its agreement with
transformers is covered by tests/model/test_model.py, whose batched decode steps take it."""
from __future__ import annotations

import os
import shutil
from typing import Callable

import pytest
import torch

from kvserve.model.layers.fused_decode import FusedDecodeStack
from kvserve.ops import build, cpu_isa
from kvserve.ops import cpu_weight as cw
from kvserve.ops import linear as linear_ops
from kvserve.ops.linear import F32_SMALL_BATCH_MAX_ROWS, small_batch_max_rows
from kvserve.ops.lora import CPU_KERNEL_MAX_TOKENS as LORA_KERNEL_MAX_TOKENS
from tests.model.test_model import (CHECKPOINTS, AttentionMetadata, Seq, assert_steps_bit_identical,
                                    blocks_for, load, model_config, random_tokens,
                                    shuffled_blocks)

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get(build.DISABLE_ENV, "") not in ("", "0"), reason="no C++ kernels")

CACHE_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}


def load_both(path: str, dtype: str):
    # Plain weights beside any prepacked ones (the policy's choice for float32 on the vector
    # tiers), so that every dtype mode qualifies on every tier.
    widened = model_config(path, dtype).weight_dtype is not None
    plan = cw.WeightPlan(cw.WIDENED if widened else cw.PREPACKED_WITH_COPY)
    fused, cfg = load(path, dtype, plan)
    plain, _ = load(path, dtype, plan)
    plain.model._fused_decode_decided = True      # the layer-by-layer path
    return fused, plain, cfg


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama-bias"])
def test_fused_decode_is_bit_identical(name: str, dtype: str, make_checkpoint: Callable[..., str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule of small steps -- pure decodes of 3 and 1 rows (different lengths), decodes
    mixed with short prefill chunks, a 4-token chunk with a cached prefix (speculative
    decoding's verification) -- and steps of 9-17 tokens (the op up to its row limit,
    16 for float32 activations and 8 for bfloat16, or every step where every projection has
    a prepacked copy; else the layer path in both): logits and
    every layer's KV cache equal bit for bit with the fused path on and off, and it ran
    exactly the steps within its limit."""
    path = CHECKPOINTS[name](make_checkpoint)
    if dtype == "auto":   # a bf16 checkpoint: 16-bit weights, float32 math without bf16 ISA
        path = make_checkpoint(name.split("-")[0], save_dtype=torch.bfloat16,
                               **({"head_dim": 32} if name == "qwen3" else {}),
                               **({"attention_bias": True, "mlp_bias": True}
                                  if name == "llama-bias" else {}))
    fused, plain, cfg = load_both(path, dtype)
    pool = shuffled_blocks(3)
    a, b, c = (Seq(random_tokens(24, 20 + i, cfg.vocab_size), blocks_for(24, pool))
               for i in range(3))
    schedule = [  # (decodes [(seq, position)], prefill chunks [(seq, start, end)])
        ([], [(a, 0, 9)]),                         # 9 tokens: layer path
        ([(a, 9)], [(b, 0, 5)]),                   # decode + a first chunk
        ([(a, 10), (b, 5)], [(c, 0, 6)]),          # 8 tokens
        ([(a, 11), (b, 6)], [(c, 6, 20)]),         # 16 tokens (float32: the op's limit)
        ([(a, 12), (c, 20)], [(b, 7, 22)]),        # 17 tokens: layer path
        ([(b, 22)], [(a, 13, 17)]),                # a verification-like chunk on a prefix
        ([(a, 17), (b, 23), (c, 21)], []),         # decodes of three lengths
        ([(c, 22)], []),                           # batch 1
    ]
    ran: list[int] = []
    call = FusedDecodeStack.__call__

    def counting(self, positions, *args, **kwargs):
        ran.append(positions.numel())
        return call(self, positions, *args, **kwargs)
    monkeypatch.setattr(FusedDecodeStack, "__call__", counting)
    assert_steps_bit_identical(fused, plain, cfg, CACHE_DTYPE[dtype], schedule)
    assert fused.model._fused_decode is not None       # it ran
    assert plain.model._fused_decode is None
    stack = fused.model._fused_decode
    limit = small_batch_max_rows(stack.act_dtype)
    # With a prepacked copy beside every projection the op runs oneDNN past the kernel's
    # rows, as the layer path does, and takes steps of any size (to the LoRA kernel's limit).
    layer = fused.model.layers[0]
    if all(lin.linear_weight.small_step_packed() is not None for lin in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)):
        limit = LORA_KERNEL_MAX_TOKENS
    assert stack.max_rows == limit
    sizes = [len(d) + sum(e - s for _, s, e in p) for d, p in schedule]
    assert ran == [n for n in sizes if n <= limit], (ran, sizes)


def test_prepacked_copies_above_the_onednn_limit(make_checkpoint: Callable[..., str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of more rows than ops.linear.onednn_above_rows run each projection's prepacked
    oneDNN copy on both paths (6 rows on AVX-512 by default; forced to 2 here so that every
    tier runs the op's branch): bit-identical, where the kernel's dot products would not be."""
    key = (cpu_isa.selected_tier(), torch.float32)
    monkeypatch.setitem(linear_ops.ONEDNN_ABOVE_ROWS, key, 2)
    linear_ops._onednn_above.cache_clear()
    try:
        fused, plain, cfg = load_both(CHECKPOINTS["llama"](make_checkpoint), "float32")
        assert fused.model.layers[0].mlp.down_proj.linear_weight.small_step_packed() \
            is not None
        pool = shuffled_blocks(3)
        a, b, c = (Seq(random_tokens(24, 30 + i, cfg.vocab_size), blocks_for(24, pool))
                   for i in range(3))
        schedule = [([], [(a, 0, 7)]), ([(a, 7)], [(b, 0, 6)]), ([(a, 8), (b, 6)], []),
                    ([(a, 9), (b, 7)], [(c, 0, 2)]), ([(c, 2)], [])]
        assert_steps_bit_identical(fused, plain, cfg, torch.float32, schedule)
        assert fused.model._fused_decode.onednn_above == 2 and fused.model._fused_decode.steps
    finally:
        linear_ops._onednn_above.cache_clear()


def test_when_the_fused_path_applies(tiny_llama: str) -> None:
    meta = AttentionMetadata(num_decode_tokens=F32_SMALL_BATCH_MAX_ROWS,
                             slot_mapping=torch.zeros(1), block_size=4)
    assert FusedDecodeStack.applies(F32_SMALL_BATCH_MAX_ROWS, meta)
    assert FusedDecodeStack.applies(4096, meta)      # the built stack's takes() decides
    assert not FusedDecodeStack.applies(0, meta)
    # A weight kept only prepacked (no plain copy to stream) keeps the layer path.
    model, _ = load(tiny_llama, "bfloat16", cw.WeightPlan(cw.PREPACKED))
    layers = list(model.model.layers)
    if model.model.layers[0].self_attn.qkv_proj.linear_weight.streamed() is None:
        assert FusedDecodeStack.build(layers) is None
    # So does a bound backend other than CPU_ATTN.
    # Plain weights: the kernel's rows only; prepacked copies beside them: any step.
    model, _ = load(tiny_llama, "float32", cw.WeightPlan(cw.PLAIN))
    stack = FusedDecodeStack.build(list(model.model.layers))
    assert stack is not None and stack.takes(16) and not stack.takes(17)
    model, _ = load(tiny_llama, "float32", cw.WeightPlan(cw.PREPACKED_WITH_COPY))
    layers = list(model.model.layers)
    stack = FusedDecodeStack.build(layers)
    prepacked = layers[0].mlp.down_proj.linear_weight.small_step_packed() is not None
    assert stack is not None and stack.takes(16) and stack.takes(4096) == prepacked
    assert not stack.takes(LORA_KERNEL_MAX_TOKENS + 1)
    assert small_batch_max_rows(torch.bfloat16) == 8     # bf16 x: the kernel only to 8 rows
    from kvserve.attention.backends.torch_sdpa import TorchSDPABackend
    layers[1].self_attn.attn.backend = TorchSDPABackend(torch.device("cpu"))
    assert FusedDecodeStack.build(layers) is None
