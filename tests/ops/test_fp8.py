"""vLLM's online --quantization fp8 (kvserve/ops/fp8.py): the e4m3 quantization with
per-output-channel weight scales and per-token activation scales, the matmul against a float64
reference, the linear layers' hook, and the start-up errors on a CPU or a GPU without fp8.

The math runs on CPU tensors (torch's CPU _scaled_mm takes float8_e4m3fn with row-wise
scales); the CUDA path (tensor cores, bfloat16 output) is checked where a GPU is present.

Bounds: e4m3 keeps 3 mantissa bits, so a value v = w / scale in the normal range rounds
within |v| / 16 (half a unit of 2^-3 relative), and in the subnormal range (|v| < 2^-6) within
2^-10 (half the spacing 2^-9): |w - w_q * scale| <= max(|w| / 16, scale * 2^-10); the row's
largest |w| maps to 448 exactly. The matmul multiplies exactly those fp8 values: against
x_deq @ w_deq^T in float64, float32 output 1e-5 and bfloat16 output 8e-3 (its rounding) of
|x_deq| @ |w_deq|^T, per element.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():   # before the Triton kernel is defined (on import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvserve.config import ModelConfig, resolve_quantization
from kvserve.ops import fp8

CUDA = torch.cuda.is_available()


def _w(n: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)  # row scales
    w[1, :] = 0.0                      # an all-zero channel: scale floor, zeros back
    w[2, 5] = 1e-7                     # far below the row's range: underflows to 0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_round_trip_within_e4m3_bounds(dtype: torch.dtype) -> None:
    w = _w(24, 80, seed=1, dtype=dtype)
    w_q, scale = fp8.quantize_weight(w)
    assert w_q.dtype == torch.float8_e4m3fn and w_q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (24,)
    wf = w.float()
    amax = wf.abs().amax(1)
    torch.testing.assert_close(scale, (amax / 448).clamp(min=fp8.MIN_SCALE))
    back = fp8.dequantize(w_q, scale)
    assert torch.isfinite(back).all()
    bound = torch.maximum(wf.abs() / 16, scale.unsqueeze(1) * 2.0 ** -10)
    assert ((back - wf).abs() <= bound * (1 + 1e-6)).all()
    assert (w_q.float().abs().amax(1)[amax > 0] == 448).all()     # the full range is used
    assert (back[1] == 0).all()
    # Per channel, not per tensor: the smallest rows keep their relative precision.
    rel = (back - wf).abs().sum(1) / wf.abs().sum(1).clamp(min=1e-30)
    assert rel[0] < 0.05 and rel[-1] < 0.05


def test_activations_are_scaled_per_token() -> None:
    x = torch.randn(5, 64)
    x[3] *= 1000.0
    x[4] = 0.0
    x_q, s = fp8.quantize_activations(x)
    assert s.shape == (5, 1)
    torch.testing.assert_close(s[:4, 0], x[:4].abs().amax(1) / 448)
    back = fp8.dequantize(x_q, s)
    assert ((back - x).abs() <= torch.maximum(x.abs() / 16, s * 2.0 ** -10) * (1 + 1e-6)).all()
    assert (back[4] == 0).all()


def test_triton_activation_quantization_equals_torch() -> None:
    """The CUDA path's one-kernel per-token quantization (ops/triton/fp8.py; interpreted on
    CPU) gives torch's values bit for bit: rows of very different ranges, an all-zero row,
    subnormal-range values, exact ties, a strided x (its other columns NaN)."""
    pytest.importorskip("triton")
    from kvserve.ops.triton.fp8 import quantize_rows
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(9)
    buf = torch.full((6, 120), float("nan"))
    buf[:, :100] = torch.randn(6, 100, generator=g) * torch.logspace(-4, 4, 6).unsqueeze(1)
    buf[2, :100] = 0.0
    buf[3, :8] = torch.tensor([448.0, 0.001, -0.001, 1e-5, 17.0, 18.0, -19.0, 240.0])
    for dtype in (torch.float32, torch.bfloat16):
        x = buf.to(dtype)[:, :100]
        q, s = quantize_rows(x.to(dev))
        rq, rs = fp8._quantize_rows(x)
        assert torch.equal(s.cpu(), rs)
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)), dtype


def _reference(x: torch.Tensor, w_q: torch.Tensor, scale: torch.Tensor,
               bias: "torch.Tensor | None") -> tuple[torch.Tensor, torch.Tensor]:
    x_q, xs = fp8.quantize_activations(x.reshape(-1, x.shape[-1]))
    xd = fp8.dequantize(x_q, xs).double()
    wd = fp8.dequantize(w_q, scale).double()
    ref, bound = xd @ wd.t(), xd.abs() @ wd.abs().t()
    if bias is not None:
        ref, bound = ref + bias.double(), bound + bias.double().abs()
    return ref, bound


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)],
                         ids=["f32", "bf16"])
@pytest.mark.parametrize("k", [64, 40], ids=["scaled_mm", "k40-dequantized"])
def test_fp8_linear_matches_float64_reference(dtype: torch.dtype, tol: float, k: int) -> None:
    """_scaled_mm (K, N multiples of 16) and the dequantized fallback (K = 40); leading dims,
    bias; one row of x alone gives its row of the batch (per-token scales)."""
    w_q, scale = fp8.quantize_weight(_w(48, k, seed=2))
    x = torch.randn(3, 7, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(48).to(dtype)
    y = fp8.fp8_linear(x, w_q, scale, bias)
    assert y.shape == (3, 7, 48) and y.dtype == dtype
    ref, bound = _reference(x, w_q, scale, bias)
    err = (y.reshape(21, 48).double() - ref).abs()
    assert (err <= tol * bound + 1e-12).all(), float((err / bound).max())
    one = fp8.fp8_linear(x[1, 2:3], w_q, scale, bias)
    torch.testing.assert_close(one[0], y[1, 2], rtol=1e-5, atol=1e-5)
    # And against the unquantized weights: two e4m3 roundings (1/16 each) at most.
    exact = x.reshape(21, k).double() @ _w(48, k, seed=2).double().t() + bias.double()
    assert ((y.reshape(21, 48).double() - exact).abs() <= 0.13 * bound + 0.02).all()


def test_linear_layers_take_fp8_weights() -> None:
    """The loader's hook on real layers (TP 1): weights become e4m3 (the 16-bit Parameter
    emptied), forward = fp8_linear on the loaded weight; LoRA-free paths unchanged."""
    from kvserve.model.layers.linear import (MergedColumnParallelLinear, RowParallelLinear,
                                             quantize_linear_weights_fp8)
    torch.manual_seed(0)
    with torch.device("cpu"):
        up = MergedColumnParallelLinear(64, [32, 32], bias=False).to(torch.bfloat16)
        down = RowParallelLinear(32, 64, bias=True).to(torch.bfloat16)
    gate, upw, dw = _w(32, 64, 4), _w(32, 64, 5), _w(64, 32, 6)
    up.weight_loader(up.weight, gate, 0)
    up.weight_loader(up.weight, upw, 1)
    down.weight_loader(down.weight, dw)
    down.weight_loader(down.bias, torch.randn(64).to(torch.bfloat16))
    for layer in (up, down):      # as the loader leaves them before the hook
        from kvserve.ops.cpu_weight import CpuLinearWeight
        layer.linear_weight = CpuLinearWeight(layer.weight, torch.bfloat16)
    assert quantize_linear_weights_fp8(nn.Sequential(up, down)) == 2
    assert isinstance(up.linear_weight, fp8.Fp8LinearWeight) and up.weight.numel() == 0
    assert up.linear_weight.nbytes == 64 * 64 + 4 * 64
    x = torch.randn(5, 64).to(torch.bfloat16)
    h = up(x)
    w_q, s = fp8.quantize_weight(torch.cat((gate, upw)))
    assert torch.equal(h, fp8.fp8_linear(x, w_q, s))
    y = down(h[:, :32])
    ref, bound = _reference(h[:, :32], *fp8.quantize_weight(dw), down.bias)
    assert ((y.double() - ref).abs() <= 8e-3 * bound + 1e-12).all()


def test_clear_errors_before_loading() -> None:
    with pytest.raises(ValueError, match=r"--quantization fp8.*CUDA GPU.*'cpu'"):
        resolve_quantization("fp8", False, "cpu")
    with pytest.raises(ValueError, match=r"--quantization fp8.*compute capability 8\.0 has no "
                                         r"fp8.*>= 8\.9"):
        resolve_quantization("fp8", False, "cuda", gpu_capability=(8, 0))
    with pytest.raises(ValueError, match="compute capability 7.5"):
        fp8.check_fp8_supported("cuda:1", (7, 5))
    assert resolve_quantization("fp8", False, "cuda", gpu_capability=(8, 9)) == "fp8"
    assert resolve_quantization("fp8", False, "cuda", gpu_capability=(9, 0)) == "fp8"
    with pytest.raises(ValueError, match="GGUF file is quantized already"):
        resolve_quantization("fp8", True, "cuda", gpu_capability=(9, 0))
    # From the config, before anything is read: the path does not exist.
    with pytest.raises(ValueError, match="--quantization fp8"):
        ModelConfig.from_path("/nonexistent/model", tokenizer=None, served_model_name=None,
                              dtype="bfloat16", max_model_len=None, seed=0, max_logprobs=20,
                              device="cpu", quantization="fp8")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_scaled_mm_path() -> None:
    """The real path: _scaled_mm on the GPU's fp8 tensor cores (bfloat16 out), or the clear
    error where the GPU has none."""
    reason = fp8.fp8_unsupported_reason("cuda")
    if reason is not None:
        with pytest.raises(ValueError, match="compute capability"):
            fp8.check_fp8_supported("cuda")
        return
    w_q, scale = fp8.quantize_weight(_w(256, 512, seed=7).cuda())
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(33, 512, device="cuda").to(dtype)
        y = fp8.fp8_linear(x, w_q, scale)
        assert y.dtype == dtype
        ref, bound = _reference(x, w_q, scale, None)
        assert ((y.double() - ref).abs() <= 8e-3 * bound + 1e-9).all()


@pytest.mark.skipif(not CUDA or fp8.fp8_unsupported_reason("cuda") is not None,
                    reason="needs a CUDA GPU with fp8")
def test_engine_serves_fp8_close_to_bf16(tiny_llama) -> None:
    """--quantization fp8 through the engine (CUDA graphs on): every generated token is in
    the bf16 run's top 3 at its first divergence, and the first token's logprob is close."""
    from kvserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = ["Hello, my name is", "The capital of France is"]
    outs = []
    for quant in (None, "fp8"):
        with LLM(tiny_llama, dtype="bfloat16", device="cuda", max_model_len=256,
                 multiprocessing=False, quantization=quant) as llm:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
    for ref, got in zip(*outs):
        r, g = ref.outputs[0], got.outputs[0]
        assert abs(r.logprobs[0][r.token_ids[0]].logprob
                   - g.logprobs[0][g.token_ids[0]].logprob) < 0.3
        for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)):
            if a != b:
                assert b in r.logprobs[i] and a in g.logprobs[i], (i, a, b)
                break
