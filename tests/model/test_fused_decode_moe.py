"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert and dense layer 0)
in the all-layers fused decode op (kvserve.model.layers.fused_decode): the same schedule of
small steps as test_fused_decode.py, logits and KV caches bit-identical to the layer-by-layer
path (FusedMoE's router, select_experts and C++ kernel), and the op ran every small step. An
engine run (greedy = HF float32) through the op: test_moe.py's test_greedy_matches_transformers
asserts `steps` there."""
from __future__ import annotations

import os
import shutil
from typing import Callable

import pytest
import torch

from kvserve.ops import build
from tests.model.test_fused_decode import CACHE_DTYPE, load_both
from tests.model.test_model import Seq, assert_steps_bit_identical, blocks_for, random_tokens, \
    shuffled_blocks
from tests.model.test_moe import MOE_CONFIG, MOE_OVERRIDES

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get(build.DISABLE_ENV, "") not in ("", "0"), reason="no C++ kernels")


@pytest.mark.parametrize("arch,dtype", [("mixtral", "float32"), ("qwen3_moe", "float32"),
                                        ("qwen2_moe", "float32"), ("mixtral", "auto")])
def test_moe_fused_decode_is_bit_identical(arch: str, dtype: str,
                                           make_checkpoint: Callable[..., str]) -> None:
    kw = {**MOE_CONFIG, **MOE_OVERRIDES[arch]}
    if dtype == "auto":   # bf16 experts kept bf16 under float32 math (no bf16 ISA)
        kw["save_dtype"] = torch.bfloat16
    fused, plain, cfg = load_both(make_checkpoint(arch, **kw), dtype)
    pool = shuffled_blocks(3)
    a, b, c = (Seq(random_tokens(24, 30 + i, cfg.vocab_size), blocks_for(24, pool))
               for i in range(3))
    schedule = [  # (decodes [(seq, position)], prefill chunks [(seq, start, end)])
        ([], [(a, 0, 9)]),                         # 9 tokens: layer path
        ([(a, 9)], [(b, 0, 5)]),                   # decode + a first chunk
        ([(a, 10), (b, 5)], [(c, 0, 6)]),          # 8 tokens (16 routed pairs)
        ([(b, 6)], [(a, 11, 15)]),                 # a verification-like chunk on a prefix
        ([(a, 15), (b, 7), (c, 6)], []),           # decodes of three lengths
        ([(c, 7)], []),                            # batch 1
        ([(c, 8)], []),
    ]
    assert_steps_bit_identical(fused, plain, cfg, CACHE_DTYPE[dtype], schedule)
    stack = fused.model._fused_decode
    assert stack is not None and stack.has_moe
    # every step within the op's limit ran in it: 8 rows (float32 on AVX-512: 6, where the
    # layer path hands the router to oneDNN above that)
    sizes = [len(d) + sum(e - s for _, s, e in p) for d, p in schedule]
    assert stack.steps == sum(n <= stack.max_rows for n in sizes) >= len(schedule) - 2
    assert plain.model._fused_decode is None
