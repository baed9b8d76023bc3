"""Multi-LoRA decode steps through the fused all-layers C++ op (kvserve.model.layers.fused_decode):
a mixed batch of 4 adapters (their tokens interleaved, one adapter on some projections only)
plus base requests, decoded in steps of 13 rows (float32: 9-16-row steps take the op, the
small-batch kernel doing chunks of 8 rows), equals the PEFT model per request and the
layer-by-layer path bit for bit, and the op did run those steps."""
from __future__ import annotations

import os
import shutil

import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.ops import build
from tests.lora.conftest import ADAPTERS, check_against_peft, make_peft_adapter
from tests.utils import random_prompts

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None
    or os.environ.get(build.DISABLE_ENV, "") not in ("", "0"), reason="no C++ kernels")

MAX_TOKENS = 6
ENGINE_ARGS = dict(dtype="float32", enable_lora=True, max_loras=4, max_cpu_loras=4,
                   max_lora_rank=16, max_model_len=96, enable_prefix_caching=False,
                   multiprocessing=False)


def _model(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.model.model


@pytest.fixture(scope="module")
def four_loras(lora_adapters: dict[str, str], tiny_llama: str,
               tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    fourth = make_peft_adapter(tiny_llama, str(tmp_path_factory.mktemp("lora4") / "all7b"),
                               *ADAPTERS["all7"][:4], seed=11)
    paths = [lora_adapters[name] for name in ADAPTERS] + [fourth]
    return [LoRARequest(os.path.basename(p), i + 1, p) for i, p in enumerate(paths)]


def test_mixed_lora_decode_runs_fused_and_matches(tiny_llama: str,
                                                  four_loras: list[LoRARequest]) -> None:
    prompts = random_prompts(13, 10, 30, 1000, seed=7)
    # Interleaved adapters: the op groups each projection's tokens by slot itself. 13 rows:
    # the second chunk of 8 x rows holds every adapter too.
    lora_list = [four_loras[0], four_loras[1], four_loras[2], four_loras[3], None,
                 four_loras[0], four_loras[2], four_loras[1], None, four_loras[3],
                 four_loras[0], four_loras[1], four_loras[2]]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, ignore_eos=True)
    with LLM(tiny_llama, **ENGINE_ARGS) as llm:
        model = _model(llm)
        fused_outs = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
        fused = model._fused_decode
        assert fused is not None and fused.lora_steps >= MAX_TOKENS - 1, "LoRA decodes ran fused"
        # The same batch layer by layer (no prefix cache: it recomputes everything).
        model._fused_decode = None
        try:
            plain_outs = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
        finally:
            model._fused_decode = fused
        assert fused.lora_steps < 2 * MAX_TOKENS      # the second run did not take it
    for f, p in zip(fused_outs, plain_outs):
        assert f.outputs[0].token_ids == p.outputs[0].token_ids
        got = [d[t].logprob for d, t in zip(f.outputs[0].logprobs, f.outputs[0].token_ids)]
        ref = [d[t].logprob for d, t in zip(p.outputs[0].logprobs, p.outputs[0].token_ids)]
        assert got == ref, "the fused op's LoRA steps must be bit-identical to the layer path"
    check_against_peft(tiny_llama, fused_outs, prompts, lora_list, MAX_TOKENS, 1e-4)
