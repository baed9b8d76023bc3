"""Small-batch linear (matrix-vector) for CPU decode: out = x @ weight.T + bias.

    x       [..., K]  float32 | bfloat16
    weight  [N, K]    x's dtype, or bfloat16 / float16 with float32 x (nn.Linear layout);
                      or tiled (tile_weight): [N/4, K/16, 4, 16] of any of those for
                      float32 x, [N/4, K/32, 4, 32] bfloat16 for bfloat16 x
    bias    [N]       optional, x's dtype
    -> out  [..., N]  x's dtype

A 16-bit weight with float32 x (dtype "auto" without bf16 instructions) stays 16-bit in memory
and all math is float32: small batches widen it in registers, larger ones use a float32 copy
(prepacked, or made per call: widened_linear) -- never an emulated bf16 GEMM.

At decode batch sizes a linear layer is a stream over its weight, so its speed is the memory
bandwidth, of which torch's CPU matrix-vector path reaches about half here (11-19 of 28-35
GB/s); so up to small_batch_max_rows(x.dtype) rows (8, float32 16) a C++ kernel (csrc/linear.cpp: each weight row read
once, dpbf16 / FMA, f32 accumulation) runs instead. Everything else goes to F.linear: more rows,
CUDA, other dtypes, a non-contiguous weight, a failed build, or disabled kernels. Which layout
each weight keeps: ops.cpu_weight.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from kvserve.ops import cpu_isa
from kvserve.ops.build import KERNEL_DTYPES, CpuKernel

logger = logging.getLogger(__name__)

# Largest row count linear() sends to the kernel, by x's dtype. benchmarks/linear.py on the
# benchmark Llama's shapes (one thread): bf16 beats F.linear at every M <= 8 (1.1-3x), at M = 16
# loses on two of five shapes (0.87-0.94x), so bf16 x keeps SMALL_BATCH_MAX_ROWS (which is also
# the packed int8 kernel's limit, ops.quant.weight.INT8_MAX_ROWS). float32 x goes to
# F32_SMALL_BATCH_MAX_ROWS: Zen 3 avx2, --threads 1 --clock cpu --stat median, kernel against
# the prepacked oneDNN weight the model keeps: 1.1-1.4x at M = 12 on all five shapes, at M = 16
# 1.10-1.28x on four and 0.97x on 2048x768 (down_proj); above 8 rows the kernel runs chunks of 8
# against each weight group while it is in L1, so the weight is still streamed once. That also
# lets 9-16-row steps (a 16-request decode batch) take the fused all-layers op.
SMALL_BATCH_MAX_ROWS = 8
F32_SMALL_BATCH_MAX_ROWS = 16
_MAX_ROWS = {torch.float32: F32_SMALL_BATCH_MAX_ROWS}

# Where a weight also has a prepacked oneDNN copy, the rows above which it runs oneDNN instead
# of the kernel, by (tier, x dtype); unlisted: small_batch_max_rows. On AVX-512 oneDNN's
# float32 GEMM runs full-width FMAs in register tiles that reuse each loaded x row, and overtakes
# the kernel's dot products from a few rows: Zen 5 (benchmarks/linear.py, 2 threads, median of
# 15, six shapes of the 110M Llama, SmolLM2 and the MoE benchmark), packed / kernel time 0.99-
# 1.19x at M = 1-3, 0.87-1.02x at 4-6, 0.88-0.97x at 8, 0.81-0.97x at 12, 0.71-0.89x at 16. On
# AVX2 (Zen 3) the kernel stays ahead up to 16 (above). The fused small-step op takes the same
# limit (decode_layers' onednn_above), so both paths give the same bits.
ONEDNN_ABOVE_ROWS = {("avx512", torch.float32): 6, ("avx512_bf16", torch.float32): 6}


def small_batch_max_rows(x_dtype: torch.dtype) -> int:
    """Largest row count of x (of x_dtype) that linear() sends to the small-batch kernel."""
    return _MAX_ROWS.get(x_dtype, SMALL_BATCH_MAX_ROWS)

_KERNEL = CpuKernel("linear.cpp", op="small_batch_linear", isa_op="small_batch_linear_isa",
                    what="small-batch linear", fallback="F.linear")
cpu_kernel: Callable[[], Optional[Callable[..., torch.Tensor]]] = _KERNEL.get
cpu_kernel_isa: Callable[[], Optional[str]] = _KERNEL.isa


# 16-bit weight storages the kernel widens to float32 for float32 x.
WIDENED_WEIGHT_DTYPES = (torch.bfloat16, torch.float16)


def kernel_takes(x_dtype: torch.dtype, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> bool:
    """Whether the kernel takes this weight (and bias) for activations of x_dtype: the same
    dtype (float32 / bfloat16), or a 16-bit weight widened for float32 x; contiguous."""
    dtypes_ok = ((x_dtype == weight.dtype and weight.dtype in KERNEL_DTYPES)
                 or (x_dtype == torch.float32 and weight.dtype in WIDENED_WEIGHT_DTYPES))
    layout_ok = weight.dim() == 2 or (is_tiled(weight) and weight.shape[3] == TILE_COLS.get(x_dtype))
    return (dtypes_ok and layout_ok and weight.is_contiguous()
            and (bias is None or (bias.dtype == x_dtype and bias.is_contiguous())))


def onednn_above_rows(x_dtype: torch.dtype) -> int:
    """Rows of x (of x_dtype) above which a weight with a prepacked copy runs oneDNN
    (ONEDNN_ABOVE_ROWS for this process's kernel tier), not the small-batch kernel."""
    return _onednn_above(cpu_isa.selected_tier(), x_dtype)


@functools.lru_cache(maxsize=None)
def _onednn_above(tier: Optional[str], x_dtype: torch.dtype) -> int:
    return min(ONEDNN_ABOVE_ROWS.get((tier, x_dtype), small_batch_max_rows(x_dtype)),
               small_batch_max_rows(x_dtype))


@functools.lru_cache(maxsize=1)
def _dispatch_kernel() -> Optional[Callable[..., torch.Tensor]]:
    # linear() runs ~50 times per decode step: the environment and the build are looked up
    # once per process (cpu_kernel() on every call cost ~4 us of the wrapper's ~6).
    return cpu_kernel()


def reset_dispatch() -> None:
    """Look the kernel (and its tiled path) up again: the process's CPU settings changed."""
    _dispatch_kernel.cache_clear()
    _tiled_kernel_works.cache_clear()
    _onednn_above.cache_clear()


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Drop-in for F.linear(x, weight, bias) (x [..., K] -> [..., N]): up to
    small_batch_max_rows(x.dtype) rows on CPU go to the C++ kernel, everything else to F.linear."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if 0 < rows <= small_batch_max_rows(x.dtype):
        x2 = x.reshape(rows, k)
        if x.device.type == "cpu" and kernel_takes(x.dtype, weight, bias):
            op = _dispatch_kernel()
            if op is not None:
                out = op(x2.contiguous(), weight, bias)
                return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features(weight))
    return _torch_linear(x, weight, bias)


def _torch_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> torch.Tensor:
    if weight.dtype != x.dtype:
        return widened_linear(x, weight, bias)
    return _gemm(x, untile_weight(weight) if is_tiled(weight) else weight, bias)


def _gemm(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear, with float32 on CPU through oneDNN's linear on the plain weight
    (_onednn_float32). Zen 5, 2 threads: the SmolLM2 tied LM head at 17 / 128 rows 13.9 ->
    5.5 / 50.6 -> 18.3 ms, 512 x 768 @ 768 x 2304 9.1 -> 4.1."""
    y = _onednn_float32(x, w, bias)
    return F.linear(x, w, bias) if y is None else y


def _onednn_float32(x: torch.Tensor, w: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """x @ w^T (+ bias) by oneDNN's linear on the plain weight, for float32 on CPU where
    packing_works; None otherwise. torch.mm / F.linear call MKL's sgemm, which on AMD CPUs
    runs its generic code (mm_t's measurement)."""
    if not (x.dtype == w.dtype == torch.float32 and x.device.type == "cpu"
            and packing_works(torch.float32)):
        return None
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.contiguous(),
                                              None if bias is None else bias.contiguous(),
                                              "none", [], "")


def widened_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear with a 16-bit weight and float32 x: the weight is widened to a temporary
    float32 copy for this call and torch's float32 GEMM does the math (no emulated bf16 GEMM).
    Used where no resident float32 copy is kept (ops.cpu_weight). The copy costs ~10 bytes of traffic per weight element against
    2 * rows FLOPs, a few % of a prefill-sized GEMM; widening tile by tile into L2-sized
    buffers measured slower here (many narrow GEMMs plus strided output writes). A tiled
    weight is untiled into the float32 copy in the same pass."""
    return _gemm(x, untile_weight(weight, x.dtype) if is_tiled(weight) else weight.to(x.dtype),
                 bias)


# ---------------------------------------------------------------------- tiled weights
TILE_ROWS = 4
# Columns per block, by the activations' dtype: float32 x (the avx2 path's widened bf16 pairs; a
# float32 weight's cache-line blocks) takes 16-column blocks, bfloat16 x (dpbf16, 32 values per
# instruction) 32-column ones.
TILE_COLS = {torch.float32: 16, torch.bfloat16: 32}


def is_tiled(weight: torch.Tensor) -> bool:
    """A weight in tile_weight's layout (4-D), not nn.Linear's [N, K]."""
    return weight.dim() == 4


def out_features(weight: torch.Tensor) -> int:
    """N of a linear weight, plain [N, K] or tiled [N/4, K/c, 4, c]."""
    return weight.shape[0] * weight.shape[2] if is_tiled(weight) else weight.shape[0]


def tile_weight(weight: torch.Tensor,
                x_dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """A weight [N, K] for activations of x_dtype in the small-batch kernel's tiled layout
    [N/4, K/c, 4, c] (each group of 4 rows stored as its c-column blocks side by side; c from
    TILE_COLS), or None where it does not apply: not a CPU weight of bf16 (any x) or float32 /
    float16 (float32 x), N % 4 or K % c not 0, or no kernel build with that tiled path (checked
    once).

    Why: a decode step streams the weight once, and 4 interleaved row streams read below one
    sequential stream: 10-15% on Zen 1 (float32 x, csrc/linear.cpp "Tiled bf16 weights"),
    17 against 28-30 GB/s on Zen 4 (bfloat16 x on dpbf16). The kernel's products and their
    order are unchanged, so outputs are bit-identical; larger batches untile into their
    float32 copy (widened_linear) or use the prepacked one."""
    cols = TILE_COLS.get(x_dtype)
    dtype_ok = (weight.dtype == torch.bfloat16
                or (x_dtype == torch.float32 and weight.dtype in (torch.float32, torch.float16)))
    if (cols is None or weight.device.type != "cpu" or not dtype_ok
            or weight.dim() != 2 or weight.shape[0] % TILE_ROWS or weight.shape[1] % cols
            or not _tiled_kernel_works(x_dtype, weight.dtype)):
        return None
    return _tiled(weight.detach(), cols).contiguous()


def _tiled(weight: torch.Tensor, cols: int) -> torch.Tensor:
    n, k = weight.shape
    return weight.view(n // TILE_ROWS, TILE_ROWS, k // cols, cols).transpose(1, 2)


def untile_weight(tiled: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """tile_weight's inverse: [N, K] in `dtype` (default: the tiled weight's)."""
    a, b, r, c = tiled.shape
    out = torch.empty(a * r, b * c, dtype=dtype or tiled.dtype, device=tiled.device)
    out.view(a, r, b, c).copy_(tiled.transpose(1, 2))
    return out


@functools.lru_cache(maxsize=None)
def _tiled_kernel_works(x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    op = _dispatch_kernel()
    if op is None:
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen).to(w_dtype)
    x = torch.randn(3, 64, generator=gen).to(x_dtype)
    try:
        same = torch.equal(op(x, _tiled(w, TILE_COLS[x_dtype]).contiguous(), None),
                           op(x, w, None))
    except RuntimeError:     # a build without this tiled path (no avx2 / no dpbf16) refuses it
        return False
    if not same:
        logger.warning("The small-batch kernel's tiled layout gave another result than the plain "
                       "one for %s weights with %s x; they stay plain.", w_dtype, x_dtype)
        return False
    logger.info("%s weights streamed by the small-batch kernel with %s math are kept tiled "
                "(4 x %d blocks, one sequential stream per step).", w_dtype, x_dtype,
                TILE_COLS[x_dtype])
    return True


# ---------------------------------------------------------------------- prepacked weights
# oneDNN keeps a weight in its own blocked layout when asked once ("prepacked", as torch's
# inductor does for frozen CPU models); F.linear re-derives that work on every call. Measured
# here with weights read from memory (benchmarks/linear.py), bf16 [4096, 768]: 3x at
# M = 1, 2.5x at M = 8, 1.6x at M = 64, 1.1x at M = 2048, bit-identical outputs; float32 2-3.8x
# (same math, another summation order). At M = 1 a packed weight alone matched the GEMV kernel
# above per call (AVX-512 Zen 4), but only plain weights can take the fused small-step path, so
# ops.cpu_weight keeps both where memory allows.
# The batch size oneDNN tunes the layout for; any M works.
PACK_BATCH_HINT = 64


def pack_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """oneDNN's prepacked copy of an nn.Linear weight [N, K] for packed_linear, or None where
    it does not apply (packing_works), or a failure (logged once)."""
    if weight.device.type != "cpu" or not packing_works(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                       PACK_BATCH_HINT)
    except Exception as e:    # an older / unusual torch build: keep the plain weight
        _log_pack_failure_once(f"{type(e).__name__}: {e}")
        return None


def packing_works(dtype: torch.dtype) -> bool:
    """Whether CPU weights of `dtype` can be prepacked: float32/bfloat16, torch with oneDNN,
    kernels not disabled (the one switch also covers oneDNN packing), and the self-check."""
    return (dtype in KERNEL_DTYPES and torch.backends.mkldnn.is_available()
            and cpu_isa.kernels_enabled() and _packing_works(dtype))


@functools.lru_cache(maxsize=None)
def _packing_works(dtype: torch.dtype) -> bool:
    """Once per dtype: prepack a small weight and check one product against F.linear, so that
    a torch build whose oneDNN lacks this path (another ISA, an older release) falls back at
    load time instead of failing in the first step."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=gen).to(dtype)
        x = torch.randn(3, 40, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        got, want = packed_linear(x, packed).float(), F.linear(x, w).float()
        # torch.allclose, not torch.testing.assert_close: the first call of the latter imports
        # torch's DTensor modules, ~0.5-1 s of every engine process's start.
        if got.shape != want.shape:
            raise ValueError(f"prepacked product has shape {tuple(got.shape)}, F.linear "
                             f"{tuple(want.shape)}")
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            raise ValueError(f"prepacked product differs from F.linear by "
                             f"{(got - want).abs().max().item():.3g}")
        return True
    except Exception as e:
        _log_pack_failure_once(f"{type(e).__name__}: {str(e)[:200]}")
        return False


@functools.lru_cache(maxsize=1)
def _log_pack_failure_once(why: str) -> None:
    logger.warning("oneDNN weight prepacking is unavailable (%s); using F.linear and the "
                   "small-batch kernel.", why)


def mm_t(x: torch.Tensor, w: torch.Tensor,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T for a weight made on the fly (dequantized GGUF chunks, widened
    experts): float32 on CPU goes through oneDNN's linear on the plain weight where
    packing_works, since torch.mm / F.linear call MKL's sgemm, which on AMD CPUs runs its
    generic code: 512 x 576 @ 576 x 3072 on one Zen 5 thread 17.4 ms, oneDNN 7.6 ms (its
    prepacked weight 7.5). Other dtypes and devices: torch.mm (bf16 already reaches oneDNN),
    written straight into `out` where given (oneDNN's linear has no out: copied there)."""
    y = _onednn_float32(x, w)
    if y is not None:
        return y if out is None else out.copy_(y)
    return torch.mm(x, w.t(), out=out)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) with a weight from pack_weight()."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
