"""CUDA graphs with LoRA on (kvserve/worker/cuda_graph.py): the capturable LoRA path.

On CPU: the code a bucket's graph is captured with (LoRAMapping.set_static over the runner's
static slots buffer, CUDAGraphRunner.static_inputs) runs eagerly on every LoRA layer of a
real model with PEFT adapters loaded (q/k/v, o, gate/up, down, the embedding), "captured"
once and "replayed" for two steps with different adapter mixes through the runner's own
refill (fill_lora, as run() does). Each step's first n rows equal the normal per-step LoRA
path; the padding rows of the bucket equal the base layer (no adapter). With the C++ kernel
and with the torch fallback. On CUDA (skipped without): graphs captured with LoRA replay
the same greedy tokens and logprobs as an eager engine, on a mixed batch of adapters + base."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.lora.layers import LoRAEmbedding, LoRALinear
from kvserve.ops import lora as cpu_lora
from kvserve.worker.cuda_graph import CUDAGraphRunner
from tests.lora.conftest import ADAPTERS
from tests.utils import EmulatedGraphs, random_prompts

if not torch.cuda.is_available():       # the emulated FULL test runs TRITON_ATTN interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

ENGINE_ARGS = dict(dtype="float32", enable_lora=True, max_loras=4, max_cpu_loras=4,
                   max_lora_rank=16, max_model_len=96, multiprocessing=False)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner


@pytest.fixture(scope="module")
def loaded(tiny_llama: str, lora_adapters: dict[str, str]):
    """An engine on CPU whose slots hold the three test adapters (one generate call)."""
    loras = [LoRARequest(name, i + 1, lora_adapters[name]) for i, name in enumerate(ADAPTERS)]
    # On CPU also on a GPU host: the test drives the capture path eagerly with CPU tensors.
    with LLM(tiny_llama, device="cpu", **ENGINE_ARGS) as llm:
        llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=1), lora_request=loras,
                     use_tqdm=False)
        mgr = _runner(llm).lora_manager
        yield llm, mgr, [mgr._slots.index(lr.lora_int_id) for lr in loras]


def _layers(mgr) -> list:
    return [layer for layer in mgr.layers.values()
            if isinstance(layer, (LoRALinear, LoRAEmbedding))]


def _inputs(layer, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, a stand-in base output the delta is added to) of `rows` tokens."""
    y = torch.randn(rows, layer.b_stack.shape[1], generator=gen)
    if isinstance(layer, LoRAEmbedding):
        return torch.randint(0, layer.base.num_embeddings, (rows,), generator=gen), y
    return torch.randn(rows, layer.base.input_size, generator=gen), y


def _normal(mgr, slots: np.ndarray) -> None:
    """The per-step mapping prepare_step sets (interleaved adapters: the sorted tokens too)."""
    mgr.mapping.set(slots, torch.device("cpu"))
    if all(isinstance(g, slice) for _, g in mgr.mapping.groups):
        mgr.sorted_tokens.clear()
    else:
        mgr.sorted_tokens.set(slots, torch.device("cpu"))


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp-kernel", "torch"])
def test_static_capture_path_equals_eager_lora(loaded, kernel: bool) -> None:
    llm, mgr, slot_of = loaded
    s0, s1, s2 = slot_of
    n, b = 5, 8                       # 5 decodes in the bucket of 8: 3 padding rows
    steps = [np.array([s0, -1, s1, s2, s0]), np.array([s2, s2, -1, s1, -1])]
    layers = _layers(mgr)
    assert {type(layer) for layer in layers} == {LoRALinear, LoRAEmbedding}
    gen = torch.Generator().manual_seed(0)
    inputs = [[_inputs(layer, b, gen) for layer in layers] for _ in steps]
    cpu_lora.set_kernels_enabled(kernel)
    runner = CUDAGraphRunner(_runner(llm).model, [], [1, 2, 4, 8], 4, torch.device("cpu"),
                             lora=mgr)
    try:
        with torch.inference_mode():
            # The normal LoRA path of each step, on its n real rows.
            want = []
            for slots, ins in zip(steps, inputs):
                _normal(mgr, slots)
                want.append([layer.apply(x[:n], y[:n].clone())
                             for layer, (x, y) in zip(layers, ins)])
            # "Capture" once: the static mapping a bucket's graph holds.
            runner.static_inputs(b)
            captured = mgr.mapping.groups
            assert captured.static
            assert captured.token_slots.data_ptr() == runner.lora_slots.buf.data_ptr()
            for slots, ins, ref in zip(steps, inputs, want):
                _normal(mgr, slots)                     # prepare_step, then run()'s refill
                runner.fill_lora(n, b)
                mgr.mapping.groups, mgr.mapping.num_tokens = captured, b      # "replay"
                for layer, (x, y), r in zip(layers, ins, ref):
                    got = layer.apply(x, y.clone())
                    name = f"{type(layer).__name__} {layer.modules}"
                    torch.testing.assert_close(got[:n], r, rtol=1e-5, atol=1e-5, msg=name)
                    assert torch.equal(got[n:], y[n:]), f"{name}: a padding row got a delta"
    finally:
        mgr.mapping.clear()
        mgr.sorted_tokens.clear()
        cpu_lora.set_kernels_enabled(True)


def test_full_mode_buckets_with_lora_equal_eager(tiny_llama: str,
                                                 lora_adapters: dict[str, str]) -> None:
    """cudagraph_mode FULL with LoRA, on CPU (the kernels interpreted, the graphs emulated:
    tests/utils.EmulatedGraphs): 6 requests of 3 adapters + base over 16-token steps, so mixed
    buckets (chunked prompts beside decodes) and decode buckets replay with the step's slots
    refilled, then 3 base requests alone replay the plain graphs. Tokens and logprobs equal an
    engine without graphs."""
    loras = [LoRARequest(name, i + 1, lora_adapters[name]) for i, name in enumerate(ADAPTERS)]
    lora_list = [loras[i % 4] if i % 4 < 3 else None for i in range(6)]
    prompts = random_prompts(6, 5, 30, vocab=1000, seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1, ignore_eos=True)
    kw = dict(ENGINE_ARGS, device="cpu", attention_backend="TRITON_ATTN", max_num_seqs=4,
              max_num_batched_tokens=16, enable_prefix_caching=False,
              compilation_config={"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 16})
    with LLM(tiny_llama, **kw) as llm:
        eager = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
        eager += llm.generate(prompts[:3], sp, use_tqdm=False)
    with LLM(tiny_llama, **kw) as llm:
        runner = _runner(llm)
        decode, mixed = runner.graph_buckets()
        graphs = EmulatedGraphs(runner.model, runner.kv_caches, decode, runner.max_blocks_per_req,
                                runner.device, lora=runner.lora_manager, mixed_sizes=mixed,
                                max_num_seqs=4)
        graphs.capture_buckets(graphs.buckets())
        runner.cuda_graphs = graphs
        got = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
        lora_replays, lora_mixed = graphs.replays - graphs.plain_replays, graphs.mixed_replays
        got += llm.generate(prompts[:3], sp, use_tqdm=False)
    for g, e in zip(got, eager, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        diffs = [abs(d[t].logprob - f[t].logprob)
                 for d, f, t in zip(g.outputs[0].logprobs, e.outputs[0].logprobs,
                                    g.outputs[0].token_ids)]
        assert max(diffs) < 1e-4
    assert lora_replays > 0 and lora_mixed > 0 and graphs.plain_replays > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_with_lora_equal_eager(tiny_llama: str, lora_adapters: dict[str, str]) -> None:
    """Graphs captured with LoRA on (before any adapter was loaded) replay each request's
    tokens and logprobs as an eager engine does: 11 requests of 3 adapters (one on the
    embedding and LM head) + base, decoding in the 16 bucket (padding rows) and smaller; then
    5 base requests alone, which replay the buckets captured without LoRA."""
    loras = [LoRARequest(name, i + 1, lora_adapters[name]) for i, name in enumerate(ADAPTERS)]
    lora_list = [loras[i % 4] if i % 4 < 3 else None for i in range(11)]
    prompts = random_prompts(11, 5, 40, vocab=1000, seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    kw = dict(ENGINE_ARGS, max_num_seqs=16, device="cuda", attention_backend="TRITON_ATTN")
    with LLM(tiny_llama, enforce_eager=True, **kw) as llm:
        eager = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
        eager += llm.generate(prompts[:5], sp, use_tqdm=False)
    with LLM(tiny_llama, enforce_eager=False, **kw) as llm:
        graphs = _runner(llm).cuda_graphs
        assert graphs is not None and graphs.lora_slots is not None
        graphed = llm.generate(prompts, sp, lora_request=lora_list, use_tqdm=False)
        mixed_replays, mixed_plain = graphs.replays, graphs.plain_replays
        # Base requests alone (after adapters ran: their slots still loaded) replay the
        # buckets captured without LoRA.
        graphed += llm.generate(prompts[:5], sp, use_tqdm=False)
        base_plain = graphs.plain_replays - mixed_plain
    for g, e in zip(graphed, eager, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        got = [d[t].logprob for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        ref = [d[t].logprob for d, t in zip(e.outputs[0].logprobs, e.outputs[0].token_ids)]
        assert max(abs(x - y) for x, y in zip(got, ref)) < 1e-3
    # Which graphs ran, after the outputs (a step on the wrong graph shows as wrong tokens).
    assert mixed_replays > 0 and mixed_plain == 0 and base_plain > 0
