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
from kvserve.ops import build
from kvserve.ops import cpu_weight as cw
from kvserve.ops.linear import SMALL_BATCH_MAX_ROWS
from tests.model.test_model import (CHECKPOINTS, AttentionMetadata, Seq, blocks_for, kv_caches,
                                    load, model_config, random_tokens, run_step,
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
def test_fused_decode_is_bit_identical(name: str, dtype: str,
                                       make_checkpoint: Callable[..., str]) -> None:
    """A schedule of small steps -- pure decodes of 3 and 1 rows (different lengths), decodes
    mixed with short prefill chunks, a 4-token chunk with a cached prefix (speculative
    decoding's verification) -- and steps above 8 tokens (the layer path in both): logits and
    every layer's KV cache equal bit for bit with the fused path on and off, and it ran."""
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
        ([(a, 11), (b, 6)], [(c, 6, 14)]),         # 10 tokens: layer path
        ([(b, 7)], [(a, 12, 16)]),                 # a verification-like chunk on a prefix
        ([(a, 16), (b, 8), (c, 14)], []),          # decodes of three lengths
        ([(c, 15)], []),                           # batch 1
    ]
    caches_f = kv_caches(cfg, CACHE_DTYPE[dtype], fill="garbage")
    caches_p = [t.clone() for t in caches_f]
    for step, (decodes, prefills) in enumerate(schedule):
        out_f = run_step(fused, caches_f, decodes=decodes, prefills=prefills)
        out_p = run_step(plain, caches_p, decodes=decodes, prefills=prefills)
        assert torch.equal(out_f, out_p), (step, (out_f - out_p).abs().max().item())
        assert all(torch.equal(x, y) for x, y in zip(caches_f, caches_p)), step
    assert fused.model._fused_decode is not None       # it ran
    assert plain.model._fused_decode is None


def test_when_the_fused_path_applies(tiny_llama: str) -> None:
    meta = AttentionMetadata(num_decode_tokens=SMALL_BATCH_MAX_ROWS,
                             slot_mapping=torch.zeros(1), block_size=4)
    assert FusedDecodeStack.applies(SMALL_BATCH_MAX_ROWS, meta)
    assert not FusedDecodeStack.applies(SMALL_BATCH_MAX_ROWS + 1, meta)   # kernel's row limit
    assert not FusedDecodeStack.applies(0, meta)
    # A weight kept only prepacked (no plain copy to stream) keeps the layer path.
    model, _ = load(tiny_llama, "bfloat16", cw.WeightPlan(cw.PREPACKED))
    layers = list(model.model.layers)
    if model.model.layers[0].self_attn.qkv_proj.linear_weight.streamed() is None:
        assert FusedDecodeStack.build(layers) is None
    # So does a bound backend other than CPU_ATTN.
    model, _ = load(tiny_llama, "float32", cw.WeightPlan(cw.PREPACKED_WITH_COPY))
    layers = list(model.model.layers)
    assert FusedDecodeStack.build(layers) is not None
    from kvserve.attention.backends.torch_sdpa import TorchSDPABackend
    layers[1].self_attn.attn.backend = TorchSDPABackend(torch.device("cpu"))
    assert FusedDecodeStack.build(layers) is None
