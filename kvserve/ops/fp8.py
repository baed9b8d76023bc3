"""vLLM's online `--quantization fp8`: a 16-bit checkpoint's linear weights cast to float8 at load.

    w_q, w_scale = quantize_weight(w)        # [N, K] -> float8_e4m3fn [N, K], float32 [N]
    y = fp8_linear(x, w_q, w_scale, bias)    # x [..., K] in its dtype -> [..., N] in x's dtype

Weights: one scale per output channel (row), w_scale[n] = max|w[n]| / 448, w_q = w / w_scale
rounded to e4m3 (saturated at +-448, e4m3fn's largest finite value). Activations: dynamic, one
scale per token (row of x), made on the device every call (one Triton kernel on CUDA), as
vLLM's fp8 path does with its per-token activation quantization. The matmul is torch._scaled_mm with both row-wise scales:
y = (x_q @ w_q^T) * x_scale * w_scale^T, float32 accumulation in fp8 tensor cores (compute
capability >= 8.9: Ada, Hopper); where _scaled_mm cannot take the shape (K or N not a multiple
of 16) the fp8 blocks are dequantized to x's dtype for F.linear (same values, no fp8 speed).
A decode step then streams 1 byte a weight instead of 2. Nothing reads device data on the host:
CUDA-graph safe.

`fp8_unsupported_reason(device, capability)` is the start-up check (config resolution raises
its reason before the model loads). The math runs on CPU tensors too (torch's CPU
_scaled_mm): tests check it there; the engine refuses fp8 on CPU (no fp8 arithmetic to gain).

Fp8LinearWeight is the weight-object variant (ops.cpu_weight's interface: matmul, streamed,
rows, nbytes) that the loader gives each linear layer under --quantization fp8; the LM head and
the embeddings stay 16-bit (as in vLLM).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F

from kvserve.ops.cpu_weight import CpuLinearWeight

FP8 = "fp8"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)      # 448
MIN_CAPABILITY = (8, 9)                          # fp8 tensor cores: Ada (8.9), Hopper (9.0)
# Smallest scale: an all-zero row (or token) quantizes to zeros, never NaN.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def fp8_unsupported_reason(device: str,
                           capability: Optional[tuple[int, int]] = None) -> Optional[str]:
    """Why `--quantization fp8` cannot run on `device` ("cpu", "cuda", "cuda:1"), or None.
    `capability`: the GPU's (major, minor) compute capability (default: asked of the device)."""
    if not str(device).startswith("cuda"):
        return (f"fp8 weights need a CUDA GPU with fp8 tensor cores (compute capability >= "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper); the device is {device!r} "
                f"(on CPU, serve the 16-bit weights or a GGUF file)")
    if capability is None:
        if not torch.cuda.is_available():
            return "fp8 weights need a CUDA GPU and none is available"
        capability = torch.cuda.get_device_capability(device)
    major, minor = int(capability[0]), int(capability[1])
    if (major, minor) < MIN_CAPABILITY:
        return (f"the GPU's compute capability {major}.{minor} has no fp8 tensor cores (fp8 "
                f"needs >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper)")
    return None


def check_fp8_supported(device: str, capability: Optional[tuple[int, int]] = None) -> None:
    """A ValueError naming the flag and the reason where fp8 cannot run."""
    reason = fp8_unsupported_reason(device, capability)
    if reason is not None:
        raise ValueError(f"--quantization fp8 is not supported here: {reason}.")


def _quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [R, C] -> (a_q float8 [R, C], scale float32 [R, 1]) with a ~= a_q * scale."""
    af = a.float()
    scale = (af.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (af / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (w_q float8_e4m3fn [N, K], w_scale float32 [N]):
    per-output-channel scales, w ~= w_q * w_scale[:, None]."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight: w must be [N, K], got {tuple(w.shape)}")
    w_q, scale = _quantize_rows(w)
    return w_q, scale.reshape(-1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q float8 [M, K], x_scale float32 [M, 1]): dynamic per-token scales.
    On CUDA one Triton kernel (ops/triton/fp8.py: the same bits as these torch ops)."""
    if x.is_cuda:
        from kvserve.ops.triton.fp8 import quantize_rows
        return quantize_rows(x)
    return _quantize_rows(x)


def dequantize(a_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """a_q * scale (per row) in float32: the values the fp8 matmul multiplies."""
    return a_q.float() * scale.reshape(-1, 1).float()


def _scaled_mm_takes(x_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    # _scaled_mm's shape rule: K and N multiples of 16 (the fp8 tensor-core tiles).
    return x_q.shape[1] % 16 == 0 and w_q.shape[0] % 16 == 0


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ (w_q * w_scale)^T (+ bias) -> [..., N] in x's dtype, x quantized per
    token to e4m3 (see the module doc)."""
    n, k = w_q.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight {k}")
    lead = x.shape[:-1]
    x_q, x_scale = quantize_activations(x.reshape(-1, k))
    if _scaled_mm_takes(x_q, w_q):
        # CUDA's row-wise scaling writes bfloat16 (the CPU kernel any float dtype).
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, n),
                             out_dtype=out_dtype)
        y = y.to(x.dtype)
    else:
        y = F.linear(dequantize(x_q, x_scale).to(x.dtype),
                     dequantize(w_q, w_scale).to(x.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, n)


class Fp8LinearWeight(CpuLinearWeight):
    """A linear weight kept as float8_e4m3fn with per-output-channel scales (the layer's 16-bit
    Parameter is emptied after quantizing)."""
    variant = FP8

    def __init__(self, weight: torch.nn.Parameter, act_dtype: torch.dtype) -> None:
        super().__init__(weight, act_dtype)
        self.w_q, self.w_scale = quantize_weight(weight.data)
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)  # never read

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fp8_linear(x, self.w_q, self.w_scale, bias)

    def streamed(self) -> Optional[torch.Tensor]:
        return None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return (dequantize(self.w_q[ids.reshape(-1)], self.w_scale[ids.reshape(-1)])
                .to(self.act_dtype).reshape(*ids.shape, -1))

    @property
    def nbytes(self) -> int:
        return self.w_q.numel() + 4 * self.w_scale.numel()


def dequantized_weight(w: Union[Fp8LinearWeight, tuple[torch.Tensor, torch.Tensor]]
                       ) -> torch.Tensor:
    """The float32 [N, K] weight an fp8 weight multiplies (a reference for tests)."""
    w_q, w_scale = (w.w_q, w.w_scale) if isinstance(w, Fp8LinearWeight) else w
    return dequantize(w_q, w_scale)
