"""GGUF MoE experts kept packed (issue 30's GGUF MoE files with issue 29's packed weights):
FusedMoE stacks each projection's GGUF blocks (layers/fused_moe/packed.py) and runs decode-sized
steps with the int8 kernel on the routed experts' blocks, prefill with dequantized GEMMs.

- the op: a decode step equals each routed expert run alone through PackedQuantWeight (the
  dense layers' int8 path, checked against float64 in tests/ops/test_quant_linear.py) within
  1e-5, and the float64 model of the dequantized weights within the int8 activations' error;
  a prefill step equals the float stacks' grouped GEMMs (fused_experts_torch) bit for bit;
  every block type, gate / up / down of one type or three;
- end to end: tiny random Qwen3-MoE / Mixtral GGUF files whose experts are quantized (the rest
  F32, so the experts are the only difference) loaded packed against the same file with the
  experts dequantized (--quantization gguf-dequantized): greedy tokens equal (tests/utils.py's
  near-tie rule at a first divergence), logprobs within PACKED_LOGPROB_ATOL; and the packed
  bytes held per expert stack equal the file's tensor bytes, no float copy kept.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.layers.fused_moe import FusedMoE, fused_experts_torch, select_experts
from kvserve.model.layers.fused_moe.packed import (PackedExperts, _experts_loop,
                                                   fused_experts_packed)
from kvserve.ops.fused import silu_and_mul
from kvserve.ops.quant import kernel as quant_kernel
from kvserve.ops.quant import weight as quant_weight
from kvserve.ops.quant.formats import FORMATS
from kvserve.ops.quant.reference import dequantize_gguf
from kvserve.ops.quant.weight import (INT8_MAX_ROWS, PackedQuantWeight, QuantizedRows,
                                      prompt_gemm_ops)
from tests.model.test_gguf_moe import ENGINE_KW, write_moe_gguf
from tests.model.test_moe import MOE_CONFIG, MOE_OVERRIDES, _prompts
from tests.ops.test_quant_linear import random_blocks
from tests.utils import check_greedy_close

pytestmark = pytest.mark.skipif(quant_kernel.ops() is None,
                                reason="the packed GGUF kernel is not built here")

# Logprob tolerance, packed (int8 activations in decode steps: ~1% relative error per MoE
# layer, INT8_REL_TOL) vs the dequantized float32 experts, on these tiny random models
# (hidden 64, peaked logits): measured at most 0.023 (Qwen3-MoE Q8_0) and 0.20 (Mixtral
# Q8_0 / Q4_1 / Q5_0) over the 6 prompts x 10 tokens; Qwen3-MoE IQ4_NL (Q8_0's activations and
# int8 weights, looked up from the nibbles) takes Q8_0's bound.
PACKED_LOGPROB_ATOL = {"qwen3_moe-Q8_0": 0.05, "mixtral-mixed": 0.3, "qwen3_moe-IQ4_NL": 0.05}
# The float64 model with unquantized activations vs the int8 kernel's: relative error norm
# (measured 0.009-0.013 for every type set here: x and the SiLU product each quantized).
INT8_REL_TOL = 0.02

E, H, I, TOP_K = 6, 256, 256, 2          # 256: the K-quants' block
TYPE_SETS = [("Q8_0", "Q8_0", "Q8_0"), ("Q4_0", "Q4_0", "Q4_1"), ("Q5_0", "Q5_1", "Q8_0"),
             ("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q4_K", "Q5_K")]


def _experts(types: tuple[str, str, str], seed: int = 0) -> tuple[FusedMoE, list[np.ndarray]]:
    """A FusedMoE loaded through its weight loader with each expert's random GGUF blocks
    (gate, up, down types), and the raw blocks per projection [E, rows, row_bytes]."""
    layer = FusedMoE(E, TOP_K, H, I, renormalize=True, ep_rank=0, ep_size=1)
    raws = []
    for j, (which, qtype) in enumerate(zip(("w1", "w3", "w2"), types)):
        n, k = (H, I) if which == "w2" else (I, H)
        raws.append(random_blocks(qtype, E * n, k, seed + j).reshape(E, n, -1))
    assert all(_load_blocks(layer, raws, types))
    return layer, raws


def _load_blocks(layer: FusedMoE, raws: list[np.ndarray], types: tuple[str, str, str]
                 ) -> list[bool]:
    """Every expert's gate / up / down blocks through the layer's weight loader, then
    process_weights_after_loading; the loader's answers (False: another EP rank's expert)."""
    loaded = []
    for e in range(E):
        for which, raw, q in zip(("w1", "w3", "w2"), raws, types):
            param = layer.w2_weight if which == "w2" else layer.w13_weight
            shape = (H, I) if which == "w2" else (I, H)
            loaded.append(layer.weight_loader(param, QuantizedRows(q, raw[e], shape), (e, which)))
    layer.process_weights_after_loading()
    return loaded


def _dequantized(raws: list[np.ndarray], types: tuple[str, str, str]) -> list[torch.Tensor]:
    """gguf's dequantization of each projection, [E, rows, cols] float32."""
    out = []
    for raw, qtype in zip(raws, types):
        per = [dequantize_gguf(raw[e], FORMATS[qtype], (raw.shape[1], -1)) for e in range(E)]
        out.append(torch.from_numpy(np.stack(per)))
    return out


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    weights, ids = select_experts(torch.randn(tokens, E, generator=gen), TOP_K, True)
    return x, weights, ids


@pytest.mark.parametrize("types", TYPE_SETS, ids=["-".join(t) for t in TYPE_SETS])
@torch.inference_mode()
def test_decode_step_reads_each_routed_experts_blocks(types) -> None:
    layer, raws = _experts(types)
    assert layer.w13_weight.numel() == 0 and layer.w2_weight.numel() == 0   # no float copy
    assert len(layer.w13_packed) == (1 if types[0] == types[1] else 2)     # gate|up fused
    x, weights, ids = _routing(5, 1)
    got = fused_experts_packed(x, *layer.expert_stacks(), weights, ids, E)
    # The C++ op (where built) = the torch-op loop it replaces, bit for bit (top-2).
    ops = quant_kernel.ops()
    assert torch.equal(got, _experts_loop(x, *layer.expert_stacks(), weights, ids, E, ops))
    # Each (token, expert) pair alone through the dense layers' packed weight (int8 path).
    shapes = [(I, H), (I, H), (H, I)]
    mats = [[PackedQuantWeight.from_gguf(q, raw[e], s) for e in range(E)]
            for q, raw, s in zip(types, raws, shapes)]
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e, xt = int(ids[t, j]), x[t:t + 1]
            act = silu_and_mul(torch.cat([mats[0][e].matmul(xt), mats[1][e].matmul(xt)], 1))
            want[t] += weights[t, j] * mats[2][e].matmul(act)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # The float64 model of the same (dequantized) weights, activations unquantized.
    g, u, d = (w.double() for w in _dequantized(raws, types))
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e, xt = int(ids[t, j]), x[t].double()
            a = torch.nn.functional.silu(g[e] @ xt) * (u[e] @ xt)
            ref[t] += weights[t, j].double() * (d[e] @ a)
    assert (got.double() - ref).norm() <= INT8_REL_TOL * ref.norm(), types


@pytest.mark.parametrize("types", TYPE_SETS[:1] + TYPE_SETS[2:4],
                         ids=["-".join(t) for t in TYPE_SETS[:1] + TYPE_SETS[2:4]])
@torch.inference_mode()
def test_prefill_step_equals_the_dequantized_float_experts(types, monkeypatch) -> None:
    """More than INT8_MAX_ROWS tokens where no int8 GEMM takes the prompt (INT8_GEMM off: a
    legacy type, or a build without one): the dequantized experts' GEMMs, bit for bit."""
    monkeypatch.setattr(quant_weight, "INT8_GEMM", False)
    layer, raws = _experts(types, seed=5)
    x, weights, ids = _routing(INT8_MAX_ROWS + 13, 2)
    g, u, d = _dequantized(raws, types)
    want = fused_experts_torch(x, torch.cat([g, u], dim=1), d, weights, ids)
    got = fused_experts_packed(x, *layer.expert_stacks(), weights, ids, E)
    if types[0] == types[1]:
        assert torch.equal(got, want)
    else:       # gate and up in two GEMMs where the float path has one
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


BF16_SETS = TYPE_SETS[:1] + TYPE_SETS[2:4]


def _prompt_rows(w: PackedQuantWeight, x: torch.Tensor) -> torch.Tensor:
    """What PackedQuantWeight.matmul does with prompt rows x (past INT8_MAX_ROWS), as float32."""
    gemm = prompt_gemm_ops(w.fmt, x)
    y = gemm.gemm(x, w.packed, w.fmt.ggml_type, w.shape[0]) if gemm else w.dequantized_matmul(x)
    return y.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("types", BF16_SETS, ids=["-".join(t) for t in BF16_SETS])
@torch.inference_mode()
def test_prefill_step_runs_the_dense_layers_prompt_path(types, dtype) -> None:
    """Hidden states above INT8_MAX_ROWS (a prefill; bf16: a bf16 model's): bit for bit the
    dense layers' path (PackedQuantWeight.matmul) on each expert's rows, the sum in float32, the
    result in x's dtype: GEMMs on the dequantized weights, or on a K-quant where the build has it
    the int8 GEMM (x in int8 blocks). Against float64 on the dtype-rounded inputs and weights:
    within 2^-7 of the result's norm for bf16 (its rounding of the two GEMMs' outputs), 1e-5 for
    float32, plus INT8_REL_TOL where the int8 GEMM ran (measured 0.0101 on the K-quant set)."""
    layer, raws = _experts(types, seed=5)
    x, weights, ids = _routing(INT8_MAX_ROWS + 13, 2)
    xb = x.to(dtype)
    got = fused_experts_packed(xb, *layer.expert_stacks(), weights, ids, E)
    assert got.dtype == dtype
    shapes = [(I, H), (I, H), (H, I)]
    mats = [[PackedQuantWeight.from_gguf(q, raw[e], sh) for e in range(E)]
            for q, raw, sh in zip(types, raws, shapes)]
    rows = torch.zeros(ids.numel(), H)
    for e in range(E):
        pairs = (ids.reshape(-1) == e).nonzero().reshape(-1)
        if len(pairs):
            xe = xb[pairs // TOP_K]
            gate_up = torch.cat([_prompt_rows(mats[0][e], xe), _prompt_rows(mats[1][e], xe)],
                                dim=1)
            act = silu_and_mul(gate_up).to(dtype)
            rows[pairs] = _prompt_rows(mats[2][e], act)
    rows.mul_(weights.reshape(-1, 1).float())
    assert torch.equal(got, rows.view(-1, TOP_K, H).sum(dim=1).to(dtype)), types
    g, u, d = (w.to(dtype).double() for w in _dequantized(raws, types))
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(TOP_K):
            e, xt = int(ids[t, j]), xb[t].double()
            a = (torch.nn.functional.silu(g[e] @ xt) * (u[e] @ xt)).to(dtype).double()
            ref[t] += weights[t, j].double() * (d[e] @ a)
    int8 = any(prompt_gemm_ops(m[0].fmt, xb) is not None for m in mats)
    rounding = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    tol = rounding + (INT8_REL_TOL if int8 else 0.0)     # x and the SiLU product in int8
    assert (got.double() - ref).norm() <= tol * ref.norm(), types


@torch.inference_mode()
def test_expert_parallel_ranks_and_float_gate_up_beside_packed_down() -> None:
    """EP: two ranks' packed halves sum to the whole layer (ids -1 skipped); a layer whose
    gate / up are float (another GGUF type) and down packed runs both kinds."""
    types = ("Q8_0", "Q8_0", "Q4_0")
    whole, raws = _experts(types, seed=3)
    x, weights, ids = _routing(3, 4)
    logits = torch.randn(3, E, generator=torch.Generator().manual_seed(4))
    want = whole(x, logits)
    halves = []
    for rank in range(2):
        layer = FusedMoE(E, TOP_K, H, I, renormalize=True, ep_rank=rank, ep_size=2)
        _load_blocks(layer, raws, types)
        assert layer.w2_packed.num_experts == E // 2
        halves.append(layer(x, logits))
    torch.testing.assert_close(halves[0] + halves[1], want, rtol=1e-6, atol=1e-6)
    g, u, _ = _dequantized(raws, types)
    mixed = FusedMoE(E, TOP_K, H, I, renormalize=True, ep_rank=0, ep_size=1)
    for e in range(E):
        mixed.weight_loader(mixed.w13_weight, g[e], (e, "w1"))
        mixed.weight_loader(mixed.w13_weight, u[e], (e, "w3"))
        mixed.weight_loader(mixed.w2_weight, QuantizedRows("Q4_0", raws[2][e], (H, I)),
                            (e, "w2"))
    mixed.process_weights_after_loading()
    assert mixed.w13_packed is None and mixed.w2_packed is not None
    # The int8 kernel on x for gate / up vs float GEMMs: within the activations' error.
    got = mixed(x, logits)
    assert (got - want).norm() <= INT8_REL_TOL * want.norm()


@torch.inference_mode()
def test_tensor_parallel_shards_of_packed_experts_sum_to_the_layer(monkeypatch) -> None:
    """TP=2: each rank keeps its block-aligned half of every expert's rows (gate / up) and
    columns (down); the ranks' partial sums (reduce_results off) add up to the whole layer."""
    from kvserve.distributed import parallel_state

    types = ("Q8_0", "Q8_0", "Q4_1")
    whole, raws = _experts(types, seed=6)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(7))
    logits = torch.randn(3, E, generator=torch.Generator().manual_seed(8))
    parts = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state._TP_STATE, "rank", rank)
        monkeypatch.setattr(parallel_state._TP_STATE, "world_size", 2)
        layer = FusedMoE(E, TOP_K, H, I, renormalize=True, reduce_results=False, ep_rank=0,
                         ep_size=1)
        _load_blocks(layer, raws, types)
        assert layer.w2_packed.shape == (H, I // 2)
        parts.append(layer(x, logits))
    torch.testing.assert_close(parts[0] + parts[1], whole(x, logits), rtol=1e-5, atol=1e-5)


def test_mixed_float_and_packed_experts_of_one_projection_is_an_error() -> None:
    layer = FusedMoE(E, TOP_K, H, I, renormalize=True, ep_rank=0, ep_size=1)
    raw = random_blocks("Q8_0", I, H, 0)
    layer.weight_loader(layer.w13_weight, QuantizedRows("Q8_0", raw, (I, H)), (0, "w1"))
    with pytest.raises(ValueError, match="a float tensor where the other experts' w13"):
        layer.weight_loader(layer.w13_weight, torch.zeros(I, H), (1, "w1"))


# ---- end to end: GGUF files with quantized experts ---------------------------------------

FILES = {  # name: (arch, the expert stacks' types: gate, up, down)
    "qwen3_moe-Q8_0": ("qwen3_moe", ("Q8_0", "Q8_0", "Q8_0")),
    "mixtral-mixed": ("mixtral", ("Q8_0", "Q4_1", "Q5_0")),
    # packed as IQ4_NL (its own kernels); hidden 64: no Q3_K / IQ4_XS blocks
    "qwen3_moe-IQ4_NL": ("qwen3_moe", ("IQ4_NL", "IQ4_NL", "IQ4_NL")),
}


@pytest.fixture(scope="module")
def packed_moe_gguf(make_checkpoint: Callable[..., str], tmp_path_factory) -> Callable[[str], str]:
    root = tmp_path_factory.mktemp("gguf_moe_packed")

    def get(name: str) -> str:
        arch, types = FILES[name]
        path = str(root / f"{name}.gguf")
        if not os.path.isfile(path):
            ckpt = make_checkpoint(arch, **MOE_CONFIG, **MOE_OVERRIDES[arch])
            write_moe_gguf(ckpt, path, arch, "F32", expert_types=dict(zip(
                ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), types)))
        return path

    return get


def _run(path: str, quantization: str) -> list:
    llm = LLM(path, quantization=quantization, **ENGINE_KW)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                            use_tqdm=False)
    finally:
        llm.shutdown()


def _as_reference(out) -> tuple[list[int], list[torch.Tensor]]:
    """A run's greedy tokens and top-5 logprobs as check_greedy_close's reference (-inf
    elsewhere)."""
    lps = []
    for pos in out.outputs[0].logprobs:
        row = torch.full((1024,), float("-inf"))
        for token, lp in pos.items():
            row[token] = lp.logprob
        lps.append(row)
    return list(out.outputs[0].token_ids), lps


@pytest.mark.parametrize("name", list(FILES))
def test_packed_experts_generate_as_the_dequantized_file(name, packed_moe_gguf, monkeypatch,
                                                         caplog) -> None:
    import tests.utils as test_utils

    path = packed_moe_gguf(name)
    with caplog.at_level("INFO", logger="kvserve.model.gguf"):
        packed = _run(path, "gguf")
    # The 2 layers' 3 expert stacks stay packed (the rest of the file is F32).
    assert any("6 tensors stay packed" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    plain = _run(path, "gguf-dequantized")
    # The first token comes from the prompt's step (41-70 tokens: the dequantized GEMMs on
    # both sides): the same float32 math.
    for p, f in zip(packed, plain):
        first = f.outputs[0].token_ids[0]
        assert p.outputs[0].token_ids[0] == first
        assert abs(p.outputs[0].logprobs[0][first].logprob
                   - f.outputs[0].logprobs[0][first].logprob) < 1e-5
    atol = PACKED_LOGPROB_ATOL[name]
    monkeypatch.setattr(test_utils, "LOGPROB_ATOL", atol)
    matched = 0
    for i, (p, f) in enumerate(zip(packed, plain)):
        tokens, lps = _as_reference(f)
        matched += check_greedy_close(tokens, lps, p, name=f"{name}[{i}]")
    # Qwen3-MoE Q8_0: near-ties rare; the Mixtral file's sharper logits diverge on 3 of 6
    # prompts (each a near-tie: the rule above), 45 of 60 positions matched.
    assert matched >= (0.8 if atol < 0.1 else 0.6) * 60, matched


def test_expert_stacks_hold_the_files_bytes(packed_moe_gguf) -> None:
    """Each packed stack is the file's tensor, byte for byte in size (rows a multiple of 8, a
    32-weight type: the interleave adds nothing), and the float Parameters are empty."""
    from kvserve.model.gguf import read_gguf_metadata
    from tests.model.test_gguf_packed import _load

    path = packed_moe_gguf("mixtral-mixed")
    sizes = {t.name: int(np.prod(t.data_shape)) * np.dtype(t.data_dtype).itemsize
             for t in read_gguf_metadata(path).tensors}
    model = _load(path)
    for i, layer in enumerate(model.model.layers):
        moe = layer.mlp.experts
        assert moe.w13_weight.numel() == moe.w2_weight.numel() == 0
        gate, up = moe.w13_packed            # Q8_0 and Q4_1: two stacks
        assert (gate.fmt.name, up.fmt.name, moe.w2_packed.fmt.name) == ("Q8_0", "Q4_1", "Q5_0")
        for stack, part in ((gate, "gate"), (up, "up"), (moe.w2_packed, "down")):
            assert isinstance(stack, PackedExperts)
            assert stack.nbytes == sizes[f"blk.{i}.ffn_{part}_exps.weight"], (i, part)


@torch.inference_mode()
def test_fused_decode_op_runs_packed_experts_bit_identically(packed_moe_gguf) -> None:
    """Small steps of a packed-experts model run all layers in the one C++ call (moe_mlp ->
    fused_moe_packed) with logits and KV caches equal bit for bit to the layer path."""
    from tests.model.test_gguf_packed import run_fused_and_layer_steps

    fused = run_fused_and_layer_steps(packed_moe_gguf("qwen3_moe-Q8_0"))
    stack = fused.model._fused_decode
    assert stack is not None and stack.has_moe, "the packed experts did not take the op"
    assert fused.model.layers[0].mlp.experts.w13_packed is not None
