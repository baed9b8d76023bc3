"""The fused-experts kernels (C++ for CPU decode steps, Triton for CUDA) against a float64
reference of routing + experts, and end to end: Mixtral and Qwen3-MoE greedy = transformers
float32 with the C++ kernel on (a profile shows the kernel ran).

The Triton kernel runs on CPU under Triton's interpreter here (as tests/ops/test_triton_fused.py).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():   # before the Triton kernels are defined (on import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.layers.fused_moe import fused_experts, select_experts  # noqa: E402
from kvserve.ops import cpu_isa  # noqa: E402
from kvserve.ops import moe as moe_ops  # noqa: E402
from tests.utils import (check_greedy_close, greedy_prefix_near_tie, hf_greedy,  # noqa: E402
                         random_prompts)

# (x dtype, weight dtype) pairs of the C++ kernel.
CPU_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
              (torch.bfloat16, torch.bfloat16)]
# Against float64: float32 math throughout (a few float32 ulps), bf16 x: the output rounded
# once to bf16 (values are O(1): an ulp is <= 1.6e-2).
CPU_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
EXPERTS, HIDDEN, INTER = 6, 40, 52      # odd sizes: vector tails on every row


def reference_moe(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  top_k: int, renormalize: bool) -> torch.Tensor:
    """float64, token by token: softmax over all experts, top-k, (renormalised) weights, each
    chosen expert's down(silu(gate x) * up x) weighted and summed."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=0)
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            gate_up = w13[e] @ x[t]
            out[t] += probs[e] / total * (w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
    return out


def make_case(num_tokens: int, x_dtype: torch.dtype, w_dtype: torch.dtype, seed: int,
              experts: int = EXPERTS, hidden: int = HIDDEN, inter: int = INTER,
              unused: tuple[int, ...] = (2, 4)) -> tuple[torch.Tensor, ...]:
    """x, router logits (experts `unused` never chosen), w13, w2."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(x_dtype)
    logits = torch.randn(num_tokens, experts, generator=gen) * 2
    logits[:, list(unused)] = -30
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(w_dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(w_dtype)
    return x, logits, w13, w2


@pytest.fixture(scope="module")
def cpu_kernel():
    if moe_ops.cpu_kernel() is None:
        pytest.skip("the C++ fused MoE kernel is not built here (disabled or no compiler)")
    return moe_ops.fused_moe_cpu


# ---- C++ kernel (CPU decode steps) ---------------------------------------------------------

@pytest.mark.parametrize("x_dtype,w_dtype", CPU_DTYPES, ids=["f32", "f32x-bf16w", "bf16"])
@pytest.mark.parametrize("num_tokens,top_k,renormalize", [(1, 2, True), (3, 1, False),
                                                          (5, 2, False), (17, 3, True)])
def test_cpu_kernel_matches_float64(cpu_kernel, x_dtype, w_dtype, num_tokens, top_k,
                                    renormalize) -> None:
    _check_against_float64(cpu_kernel, x_dtype, w_dtype, num_tokens, top_k, renormalize)


@pytest.mark.parametrize("x_dtype,w_dtype", CPU_DTYPES, ids=["f32", "f32x-bf16w", "bf16"])
def test_cpu_kernel_weight_tiles(cpu_kernel, x_dtype, w_dtype) -> None:
    """Rows long enough that an expert's weights are read in several L2 tiles (both passes),
    and more pairs an expert than one pass takes: every chunk of pairs runs over each tile."""
    _check_against_float64(cpu_kernel, x_dtype, w_dtype, 37, 2, True, hidden=WIDE_HIDDEN,
                           inter=WIDE_INTER)


# csrc/moe.cpp's tiles are 128 KiB of weight rows: gate | up rows of 2 x 2048 float32 are 16 KB
# (8-row tiles), bf16 8 KB (16 rows); down rows of 200 are 800 / 400 B (160 / 324 rows).
WIDE_HIDDEN, WIDE_INTER = 2048, 200


def _check_against_float64(cpu_kernel, x_dtype, w_dtype, num_tokens, top_k, renormalize,
                           **shape) -> None:
    x, logits, w13, w2 = make_case(num_tokens, x_dtype, w_dtype, seed=num_tokens * 10 + top_k,
                                   **shape)
    weights, ids = select_experts(logits, top_k, renormalize)
    assert not torch.isin(ids, torch.tensor([2, 4])).any()      # two experts get no tokens
    got = cpu_kernel(x, w13, w2, weights, ids)
    assert got.dtype == x_dtype and got.shape == x.shape
    want = reference_moe(x, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(got.double(), want, atol=CPU_TOL[x_dtype], rtol=0)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16w"])
@pytest.mark.parametrize("num_tokens", [1, 7, 200])
def test_dispatch_by_step_size(cpu_kernel, num_tokens: int, w_dtype: torch.dtype) -> None:
    """fused_experts: decode-sized steps go to the kernel, prefill-sized ones to the grouped
    torch GEMMs; both equal the float64 reference, with float32 x and float32 or bf16
    weights (dtype "auto" keeps a bf16 checkpoint's experts bf16: layer.py)."""
    x, logits, w13, w2 = make_case(num_tokens, torch.float32, w_dtype, seed=num_tokens)
    weights, ids = select_experts(logits, 2, True)
    takes = moe_ops.kernel_takes(x, w13, w2, ids.numel())
    assert takes == (num_tokens * 2 <= moe_ops.max_decode_pairs(torch.float32))
    got = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), reference_moe(x, logits, w13, w2, 2, True),
                               atol=CPU_TOL[torch.float32], rtol=0)


def on_one_and_two_threads(call):
    """call() with torch's intra-op threads at 1, then at 2 (restored after)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = call()
        torch.set_num_threads(2)
        return one, call()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("x_dtype,w_dtype", CPU_DTYPES, ids=["f32", "f32x-bf16w", "bf16"])
@pytest.mark.parametrize("routed", [1, 2, 3, 4])
def test_cpu_kernel_same_bits_for_every_split(cpu_kernel, x_dtype, w_dtype,
                                              routed: int) -> None:
    """1 thread (each call split by expert) against 2 (split by expert where that is exactly
    balanced: 2 routed experts with 5 pairs each; else by output rows): bit-identical, and
    equal to float64."""
    x, logits, w13, w2 = make_case(5, x_dtype, w_dtype, seed=routed,
                                   unused=tuple(range(routed, EXPERTS)))
    weights, ids = select_experts(logits, min(routed, 2), True)
    assert torch.unique(ids).numel() == routed
    one, two = on_one_and_two_threads(lambda: cpu_kernel(x, w13, w2, weights, ids))
    assert torch.equal(one, two)
    want = reference_moe(x, logits, w13, w2, min(routed, 2), True)
    torch.testing.assert_close(two.double(), want, atol=CPU_TOL[x_dtype], rtol=0)


@pytest.mark.parametrize("x_dtype,w_dtype", CPU_DTYPES, ids=["f32", "f32x-bf16w", "bf16"])
def test_cpu_kernel_rows_do_not_depend_on_the_batch(cpu_kernel, x_dtype, w_dtype) -> None:
    """A token's output is the same bits alone as in a 19-token step, where its experts' pairs
    go in chunks of up to 4 (8 on dpbf16) x rows a pass over the weights. The float32
    outputs are the sharp cases (a planted reduction order that depends on the chunk size
    fails them); bf16 outputs round most float32-level differences away."""
    x, logits, w13, w2 = make_case(19, x_dtype, w_dtype, seed=7, unused=(1, 2, 3, 4))
    weights, ids = select_experts(logits, 2, True)
    together = cpu_kernel(x, w13, w2, weights, ids)
    for t in range(x.shape[0]):
        alone = cpu_kernel(x[t:t + 1].contiguous(), w13, w2, weights[t:t + 1].contiguous(),
                           ids[t:t + 1].contiguous())
        assert torch.equal(alone[0], together[t]), t


def test_cpu_kernel_rejects_bad_input(cpu_kernel) -> None:
    x, logits, w13, w2 = make_case(2, torch.float32, torch.float32, seed=0)
    weights, ids = select_experts(logits, 2, True)
    with pytest.raises(RuntimeError, match="out of"):
        cpu_kernel(x, w13, w2, weights, torch.full_like(ids, EXPERTS))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_kernel(x[:, :-1].contiguous(), w13, w2, weights, ids)


# ---- panel-packed bf16 experts (csrc/moe_panels.h; dpbf16 builds) --------------------------

# 16-row panels: I = 48 gives 3 intermediate blocks (a 1-block tail after a 2-block step), H =
# 80 five hidden panels (a 1-panel tail after a 4-panel step); odd pair counts exercise every
# chunk size up to the 6-row microkernel.
PANEL_HIDDEN, PANEL_INTER = 80, 48


def test_pack_panels_layout() -> None:
    """pack_panels puts w[e, row, col] where csrc/moe_panels.h reads it (gate and up panels of
    the same 16 intermediates alternate), and unpack_panels inverts it."""
    e, h, i = 2, 64, 32
    w13 = torch.arange(e * 2 * i * h, dtype=torch.float32).reshape(e, 2 * i, h)
    w2 = torch.arange(e * h * i, dtype=torch.float32).reshape(e, h, i)
    p13, p2 = moe_ops.pack_panels(w13, w2)
    assert p13.shape == (e, 2 * i // 16, h // 2, 32) and p2.shape == (e, h // 16, i // 2, 32)
    for (ex, j, s, kp, r, t) in [(0, 0, 0, 0, 0, 0), (1, 1, 1, 5, 3, 1), (0, 1, 0, 31, 15, 0)]:
        assert p13[ex, 2 * j + s, kp, 2 * r + t] == w13[ex, s * i + 16 * j + r, 2 * kp + t]
    for (ex, b, kp, r, t) in [(0, 0, 0, 0, 0), (1, 3, 7, 9, 1)]:
        assert p2[ex, b, kp, 2 * r + t] == w2[ex, 16 * b + r, 2 * kp + t]
    u13, u2 = moe_ops.unpack_panels(p13, p2)
    assert torch.equal(u13, w13) and torch.equal(u2, w2)


@pytest.fixture(scope="module")
def panel_kernel(cpu_kernel):
    if not (moe_ops.cpu_kernel_isa() or "").startswith("avx512_bf16"):
        pytest.skip("panel-packed experts need the avx512_bf16 kernel build (dpbf16)")
    return cpu_kernel


def _panel_case(num_tokens: int, seed: int, top_k: int = 2, **kw):
    x, logits, w13, w2 = make_case(num_tokens, torch.bfloat16, torch.bfloat16, seed=seed,
                                   hidden=PANEL_HIDDEN, inter=PANEL_INTER, **kw)
    weights, ids = select_experts(logits, top_k, True)
    return x, logits, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (5, 1), (17, 3), (300, 2)])
def test_panel_kernel_matches_float64(panel_kernel, num_tokens: int, top_k: int) -> None:
    """Decode- and prefill-sized steps on the panel layout equal the float64 reference."""
    x, logits, w13, w2, weights, ids = _panel_case(num_tokens, num_tokens, top_k)
    p13, p2 = moe_ops.pack_panels(w13, w2)
    got = panel_kernel(x, p13, p2, weights, ids)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    want = reference_moe(x, logits, w13, w2, top_k, True)
    torch.testing.assert_close(got.double(), want, atol=CPU_TOL[torch.bfloat16], rtol=0)


def test_panel_kernel_same_bits_for_every_split_and_batch(panel_kernel) -> None:
    """1 thread against 2 (split by output panels: 3 routed experts do not divide over 2
    threads), and each token alone (2 experts of one pair each: split by expert) against the
    23-token step: the same bits."""
    x, logits, w13, w2, weights, ids = _panel_case(23, 5, unused=(3, 4, 5))
    p13, p2 = moe_ops.pack_panels(w13, w2)
    one, two = on_one_and_two_threads(lambda: panel_kernel(x, p13, p2, weights, ids))
    assert torch.equal(one, two)
    for t in range(x.shape[0]):
        alone = panel_kernel(x[t:t + 1].contiguous(), p13, p2, weights[t:t + 1].contiguous(),
                             ids[t:t + 1].contiguous())
        assert torch.equal(alone[0], two[t]), t


def test_panel_dispatch_takes_every_step_size(panel_kernel) -> None:
    """fused_experts sends panel-packed stacks to the kernel at any size; with the kernel
    switched off it unpacks them for the grouped torch GEMMs (same result within bf16)."""
    x, logits, w13, w2, weights, ids = _panel_case(600, 11)
    p13, p2 = moe_ops.pack_panels(w13, w2)
    assert moe_ops.kernel_takes(x, p13, p2, ids.numel())
    assert not moe_ops.kernel_takes(x, w13, w2, ids.numel())          # rows: prefill -> torch
    got = fused_experts(x, p13, p2, weights, ids)
    moe_ops.set_kernel_enabled(False)
    try:
        fallback = fused_experts(x, p13, p2, weights, ids)
    finally:
        moe_ops.set_kernel_enabled(True)
    want = reference_moe(x, logits, w13, w2, 2, True)
    torch.testing.assert_close(got.double(), want, atol=CPU_TOL[torch.bfloat16], rtol=0)
    # torch's bf16 GEMMs also round gate_up to bf16 before SiLU: values up to ~3 here.
    torch.testing.assert_close(fallback.double(), want, atol=CPU_TOL[torch.bfloat16], rtol=2e-2)


def test_panel_kernel_rejects_bad_input(panel_kernel) -> None:
    x, _, w13, w2, weights, ids = _panel_case(2, 0)
    p13, p2 = moe_ops.pack_panels(w13, w2)
    with pytest.raises(RuntimeError, match="out of"):
        panel_kernel(x, p13, p2, weights, torch.full_like(ids, EXPERTS))
    with pytest.raises(RuntimeError, match="panel shapes disagree"):
        panel_kernel(x[:, :-16].contiguous(), p13, p2, weights, ids)
    with pytest.raises(RuntimeError, match="bfloat16"):
        panel_kernel(x.float(), p13, p2, weights, ids)


# ---- Triton kernel (CUDA; here under the interpreter) -------------------------------------

@pytest.fixture(scope="module")
def triton_moe():
    pytest.importorskip("triton")
    from kvserve.model.layers.fused_moe import triton_moe
    return triton_moe


def test_align_block_size(triton_moe) -> None:
    """Every pair once, each block one expert's, padding = num_pairs, the padded total."""
    ids = torch.tensor([[0, 2], [2, 3], [0, 3], [3, 2]])
    sorted_ids, expert_ids, total = triton_moe.moe_align_block_size(ids, 4, 5)
    pairs = ids.numel()
    assert sorted_ids.numel() % 4 == 0 and sorted_ids.numel() >= pairs + 5 * 3
    assert int(total) == 12      # experts 0 (2 pairs), 2 (3), 3 (3): one block of 4 each
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    flat = ids.reshape(-1)
    for b in range(int(total) // 4):
        block = sorted_ids[4 * b: 4 * b + 4]
        block = block[block < pairs].long()
        assert block.numel() > 0 and (flat[block] == expert_ids[b]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 5, 17])
def test_triton_kernel_matches_float64(triton_moe, dtype: torch.dtype, num_tokens: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, logits, w13, w2 = make_case(num_tokens, dtype, dtype, seed=num_tokens, experts=4,
                                   hidden=32, inter=48, unused=(1,))
    weights, ids = select_experts(logits, 2, True)
    got = triton_moe.fused_experts_triton(x.to(device), w13.to(device), w2.to(device),
                                          weights.to(device), ids.to(device))
    want = reference_moe(x, logits, w13, w2, 2, True)
    # bf16: the activation and each expert's weighted row rounded to bf16 before the sum.
    tol = 2e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got.cpu().double(), want, atol=tol, rtol=0)


# ---- end to end: the kernel inside a model ------------------------------------------------

E2E_OVERRIDES = {
    "mixtral": dict(num_local_experts=8),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=128, norm_topk_prob=True,
                      head_dim=32),
}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_greedy_matches_transformers_with_kernel(arch: str, make_checkpoint, cpu_kernel) -> None:
    """3 prompts, 8 tokens: decode steps (6 pairs) run the C++ kernel, prefill the grouped
    GEMMs; greedy tokens = HF float32 (or the near-tie rule of tests/utils.py)."""
    path = make_checkpoint(arch, num_experts_per_tok=2, intermediate_size=128,
                           **E2E_OVERRIDES[arch])
    prompts = random_prompts(3, 5, 20, vocab=1024, seed=3)
    refs = hf_greedy(path, prompts, 8)
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20, seed=0,
              multiprocessing=False, device="cpu")     # the CPU kernel, on a GPU host too
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    calls = {e.key: e.count for e in prof.key_averages()}
    # 2 MoE layers x 7 decode steps at least (the engine core runs in this process).
    assert calls.get("kvserve::fused_moe", 0) >= 14, sorted(k for k in calls if "kvserve" in k)
    matched = sum(check_greedy_close(t, lp, o, name=f"{arch}[{i}]")
                  for i, ((t, lp), o) in enumerate(zip(refs, outs)))
    assert matched >= 0.8 * 3 * 8


def test_auto_dtype_keeps_bf16_experts(make_checkpoint, cpu_kernel) -> None:
    """dtype="auto" on a bf16 checkpoint, a CPU tier without bf16 math: the experts stay bf16 in
    memory (half the bytes per decode step; the kernel widens them in registers), decode steps
    run the kernel on them, and greedy output = HF float32 on the same checkpoint (the same
    numbers: bf16 -> float32 is exact), logprobs as close as a float32 run's."""
    if cpu_isa.has_native_bf16():
        pytest.skip("this tier has bf16 math: auto runs the checkpoint's dtype")
    path = make_checkpoint("mixtral", save_dtype=torch.bfloat16, num_experts_per_tok=2,
                           intermediate_size=128, num_local_experts=8)
    prompts = random_prompts(3, 5, 20, vocab=1024, seed=4)
    refs = hf_greedy(path, prompts, 8)
    llm = LLM(path, dtype="auto", max_model_len=128, kv_cache_memory=8 << 20, seed=0,
              multiprocessing=False, device="cpu")
    try:
        mc = llm.llm_engine.config.model_config
        assert (mc.dtype, mc.weight_dtype) == (torch.float32, torch.bfloat16)
        model = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.model
        experts = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
        assert experts and all(m.w13_weight.dtype == m.w2_weight.dtype == torch.bfloat16
                               for m in experts)
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
    finally:
        llm.shutdown()
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("kvserve::fused_moe", 0) >= 14, sorted(k for k in calls if "kvserve" in k)
    matched = 0
    for i, ((ref_tokens, ref_lps), out) in enumerate(zip(refs, outs)):
        n = check_greedy_close(ref_tokens, ref_lps, out, name=f"auto[{i}]")
        for pos in range(n):
            got = out.outputs[0].logprobs[pos][ref_tokens[pos]].logprob
            assert abs(got - ref_lps[pos][ref_tokens[pos]].item()) < 1e-3, (i, pos)
        matched += n
    assert matched >= 0.8 * 3 * 8


def test_bf16_model_runs_panel_packed_experts(make_checkpoint, panel_kernel) -> None:
    """dtype bfloat16 on a dpbf16 CPU: the experts are panel-packed at load, prefill and decode
    steps both run the kernel on them, and greedy output equals (or near-ties, each side's
    token in the other's top logprobs) a run with the kernel off, whose grouped torch GEMMs
    read the unpacked stacks."""
    path = make_checkpoint("mixtral", save_dtype=torch.bfloat16, num_experts_per_tok=2,
                           intermediate_size=128, num_local_experts=8)
    prompts = random_prompts(3, 5, 20, vocab=1024, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)

    def run(kernel: bool):
        moe_ops.set_kernel_enabled(kernel)
        llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory=8 << 20, seed=0,
                  multiprocessing=False, device="cpu")
        try:
            model = llm.llm_engine.engine_core.engine_core.model_executor.worker.model_runner.model
            experts = [m for m in model.modules() if type(m).__name__ == "FusedMoE"]
            assert experts and all(moe_ops.is_panel_packed(m.w13_weight) == kernel
                                   for m in experts)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        finally:
            llm.shutdown()
            moe_ops.set_kernel_enabled(True)
        return outs, {e.key: e.count for e in prof.key_averages()}

    packed, calls = run(True)
    plain, plain_calls = run(False)
    # 2 MoE layers x (7 decode steps + the prefill): the prefill too runs the kernel.
    assert calls.get("kvserve::fused_moe", 0) >= 16, sorted(k for k in calls if "kvserve" in k)
    assert plain_calls.get("kvserve::fused_moe", 0) == 0
    matched = sum(greedy_prefix_near_tie(a.outputs[0], b.outputs[0], name=f"panels[{i}]")
                  for i, (a, b) in enumerate(zip(packed, plain)))
    assert matched >= 0.8 * 3 * 8
