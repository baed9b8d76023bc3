"""PackedQuantWeight: a GGUF-quantized linear weight kept packed in memory.

    w = PackedQuantWeight.from_gguf("Q4_K", raw, (N, K))   # raw: GGUFReader's uint8 blocks
    y = w.matmul(x)                                        # x [..., K] -> [..., N]

matmul on CPU with the kernel built runs the int8 kernel up to INT8_MAX_ROWS rows of x (decode,
speculative verification: x quantized per block to int8 exactly as llama.cpp quantizes it for
this weight type, integer dot products), and up to INT8_DECODE_MAX_ROWS in a step of decode
tokens only (decode_step, set by the model runner): a stream over the packed bytes (0.56 - 1.06
bytes a weight instead of float32's 4). Larger batches (prefill) on the K-quants take the int8
GEMM where the build has one (INT8_GEMM: every tier from avx2), x in int8 blocks as llama.cpp
does (0.85B Q4_K_M prompt of 512, Zen 4: 244 -> 379 tok/s in bf16; on the avx2 tier, float32,
121 -> 182). Other larger batches take the weight dequantized CHUNK_ELEMS floats at a time into
a float32 temporary for oneDNN's GEMM (dequantized_matmul), x unquantized, so a prompt's hidden
states are those of the dequantized float32 model; with bfloat16 x (a bf16 model: dtype "auto"
for a packed file on a CPU with bf16 math, config.resolve_dtype) the chunks are rounded to bf16
for bf16 GEMMs, twice float32's rate. Why unquantized x there, measured: the int8 activations
of the prompt's layers moved the demo's first answer token by 0.2 nats on a near-tie
("L'Etoile" for "The capital of France is Paris."), and the logits by 0.05 more (hence
`precise` for the LM head). The price is small since the GEMMs run on oneDNN
(ops.linear.mm_t): benchmarks/quant_kernels.py --large-rows 256 512, 1 thread, SmolLM2's Q8_0 /
Q4_K shapes, Zen 5: the float path takes 0.69-0.84x the int8 kernel's time on the avx2 tier
and 1.05-1.28x on VNNI (on MKL's sgemm it was 1.4-2.3x on a Zen 3). The float path also serves
x on another device and builds without the kernel (not x86-64, no compiler,
KVSERVE_DISABLE_CPU_KERNELS=1), where the chunks are dequantized with torch ops.

On CUDA (the packed tensor moved there with `to`, same layout) matmul, dequantize and
dequantize_rows run the Triton kernels of ops/triton/quant.py, x in its own dtype.

It is shaped to become a variant of the CPU weight object (ops/cpu_weight.py): `matmul(x)`, the
bytes a step streams (`streamable`, `nbytes`), and `shard` for tensor parallelism.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import numpy as np
import torch

from kvserve.ops.linear import SMALL_BATCH_MAX_ROWS, mm_t
from kvserve.ops.quant import kernel, packing
from kvserve.ops.quant.formats import ROW_GROUP, BlockFormat, block_format
from kvserve.ops.quant.transcode import TRANSCODED, transcode

# Largest row count of x that takes the int8 kernel (the small-batch threshold of the float
# weights, ops.linear); None: every batch (see the module doc).
INT8_MAX_ROWS: Optional[int] = SMALL_BATCH_MAX_ROWS
# The same in a step of decode tokens only (decode_step: no prompt rows, whose hidden states
# stay the float path's). Decode rows then take int8 activations at every batch size, as at
# batch 1, and the kernel beats dequantize + GEMM up to ~64-128 rows (0.85B Q4_K_M / Q8_0
# layers, bf16 x, 2 threads, Zen 5 VNNI: float path / int8 time 2.8x at 16 rows, 2.0x at 32,
# 1.3-1.4x at 64, 1.0-1.1x at 128; the demo's shapes 1.1x at 64; the avx2 tier with float32
# x: 2.0x at 16, 1.0-1.1x at 64, 0.8-0.9x at 128).
INT8_DECODE_MAX_ROWS = 64
_decode_only_step: ContextVar[bool] = ContextVar("kvserve_quant_decode_only_step", default=False)


@contextmanager
def decode_step(decode_only: bool) -> Iterator[None]:
    """The model runner's mark around a step's forward: whether every row is a decode token."""
    token = _decode_only_step.set(decode_only)
    try:
        yield
    finally:
        _decode_only_step.reset(token)


def int8_max_rows() -> Optional[int]:
    """The int8 kernel's row limit in this step (INT8_DECODE_MAX_ROWS in a decode-only one)."""
    if INT8_MAX_ROWS is None or not _decode_only_step.get():
        return INT8_MAX_ROWS
    return max(INT8_MAX_ROWS, INT8_DECODE_MAX_ROWS)


# Prompts (more than INT8_MAX_ROWS rows) on the K-quants take the kernel's int8 GEMM where the
# build has one (every tier from avx2: csrc/quant_gemm.h), not GEMMs on dequantized chunks: x
# in the same int8 blocks as decode, as llama.cpp's prompts and vLLM's GGUF kernels (whatever
# the activation dtype). The 0.85B Llama's shapes at 512 rows, weights from memory, 2 threads,
# Zen 4 (benchmarks/quant_kernels.py --gemm-rows): bf16 x on the avx512_bf16 tier 1.34-1.64x
# the bf16 chunks' speed (Q4_K 585-613 GOP/s, Q6_K 501-517); float32 x on the avx2 tier (its
# default dtype) 1.63-1.87x the float32 chunks' (Q4_K 302-318 GOP/s), Q6_K 1.34-1.57x (228-248).
# Why not the legacy types' prompts, which it runs as fast: the demo (Q4_1, bf16) then answers
# "L'Étoile" to "What is the capital of France?" (-1.94 nats against "The" -1.96; the bf16
# chunks: "The" -1.74, "Paris"), and their prompts are already 1.7-4.4x llama.cpp's (2.1-2.2x
# on the avx2 tier). IQ4_NL (and IQ4_XS, rewritten as it) likewise: llama.cpp's demo IQ4_NL /
# IQ4_XS files' perplexity (bf16) went from +0.04% / -0.05% of the float32 path's to +0.73% /
# +1.15% with its prompts on the GEMM. Q8_0 too: the GEMM ran its prompts 1.7-1.9x the bf16
# chunks' speed, but llama.cpp's demo Q8_0 file's first chat token then lay 0.22 nats from the
# float32 path's logprob (the bf16 chunks: 0.11; the tests allow 0.1). Q2_K (VNNI only, its
# minimums per 16 weights as its scales): 1.22-1.43x the bf16 chunks at 512 rows; the demo
# with llama.cpp's Q2_K ffn_down: perplexity +0.39% (float32 x) / +0.23% (bf16) of the float32
# path's. Decode steps of kGemmMinRows+ rows (16 with VNNI, 64 on AVX2) take the GEMM inside
# the int8 op, every type the build has it for (not Q8_0, IQ4_NL and Q2_K on AVX2). The LM
# head (precise) keeps float x.
INT8_GEMM = True
PROMPT_GEMM_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})


def prompt_gemm_ops(fmt: BlockFormat, x: torch.Tensor) -> Optional[object]:
    """The kernel's ops where prompt rows x (past the int8 kernel's rows) on weights of `fmt`
    take its int8 GEMM (INT8_GEMM's note: float32 or bf16 x on CPU, a K-quant, a build with
    it), else None. Dense layers and MoE experts (fused_moe/packed.py) ask the same question."""
    if not INT8_GEMM or x.dtype not in (torch.bfloat16, torch.float32) or x.device.type != "cpu":
        return None
    ops = kernel.ops() if fmt.name in PROMPT_GEMM_TYPES else None
    return ops if ops is not None and ops.gemm_supports(fmt.ggml_type) else None


# Floats per dequantized chunk of the weight (4 MiB): bounds the large-batch temporary.
CHUNK_ELEMS = 1 << 20


@dataclass
class PackedQuantWeight:
    """A [N, K] weight in GGUF blocks of `fmt`, 8 rows interleaved (formats.py):
    packed [ceil(N/8), K / block_size, fmt.group_block_bytes] uint8."""
    fmt: BlockFormat
    shape: tuple[int, int]
    packed: torch.Tensor

    @classmethod
    def from_gguf(cls, qtype: object, raw: Union[np.ndarray, torch.Tensor],
                  shape: tuple[int, int]) -> "PackedQuantWeight":
        """From the raw blocks of an [N, K] tensor (GGUFReader's `data`: [N, row_bytes] uint8)
        of GGUF type `qtype` (a name, gguf.GGMLQuantizationType or its value). Repacked once."""
        fmt = block_format(qtype)
        n, k = int(shape[0]), int(shape[1])
        rows = packing.as_raw_rows(raw, fmt, (n, k))
        return cls(fmt, (n, k), packing.pack_blocks(rows, fmt))

    # ------------------------------------------------------------------ what it holds
    @property
    def qtype(self) -> str:
        return self.fmt.name

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def streamable(self) -> torch.Tensor:
        """What a small-batch step reads: the packed blocks."""
        return self.packed

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def raw_rows(self) -> torch.Tensor:
        """The GGUF blocks in file order, [N, row_bytes] uint8 (a copy)."""
        return packing.unpack_blocks(self.packed, self.shape[0], self.fmt)

    # ------------------------------------------------------------------ math
    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
               precise: bool = False) -> torch.Tensor:
        """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype (the math in float32; bf16
        GEMMs for bf16 x above INT8_MAX_ROWS). `precise` (the LM head): on the int8 path, x's
        quantization residual is a second int8 row (_precise_linear), so the logits carry
        ~15-bit activations, not 8; larger batches (prompt logprobs) take float32 GEMMs; the
        logits come back float32 whatever x's dtype (the sampler's dtype: a bf16 round trip
        would undo the residual row)."""
        n, k = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        if self.packed.is_cuda:         # the Triton kernels (ops/triton/quant.py), x's dtype
            from kvserve.ops.triton.quant import quant_matmul
            return quant_matmul(x2, self.packed, self.fmt, n, bias).reshape(*lead, n)
        # bf16 x stays bf16 (the kernel widens it and rounds y itself, same bits; the large
        # path's GEMMs run bf16, twice float32's rate) except for the LM head; others float32.
        keep_bf16 = x2.dtype == torch.bfloat16 and not precise
        xs = x2 if keep_bf16 or x2.dtype == torch.float32 else x2.float()
        ops = kernel.ops() if x.device.type == "cpu" else None
        rows, limit = x2.shape[0], int8_max_rows()
        int8 = ops is not None and 0 < rows and (limit is None or rows <= limit)
        xk = xs if bias is None else xs.float()         # a bias is added to float32 y
        gemm = None if int8 or precise else prompt_gemm_ops(self.fmt, xk)
        if gemm is not None:
            y = gemm.gemm(xk.contiguous(), self.packed, self.fmt.ggml_type, n)
        elif int8:
            y = (self._precise_linear(ops, xs.contiguous()) if precise
                 else ops.linear(xk.contiguous(), self.packed, self.fmt.ggml_type, n))
        else:
            y = self.dequantized_matmul(xs)
        if bias is not None:
            y = y + bias.float()
        return (y.float() if precise else y.to(x.dtype)).reshape(*lead, n)

    def _precise_linear(self, ops, x: torch.Tensor) -> torch.Tensor:
        """W (x_q + r_q): x_q is x's int8 blocks (the kernel's own quantization of x), r_q the
        int8 blocks of the residual r = x - x_q, quantized with their own, ~254x finer scales.
        One kernel call on the 2M rows [x; r]: the weight is streamed once, so at decode sizes
        (memory-bound) it costs little; the logits' near-ties then fall where float32's do."""
        m, k = x.shape
        q, d, _, _ = ops.quantize_x(x, self.fmt.ggml_type)
        blk = self.fmt.act_block
        xq = (q.view(m, k // blk, blk).float() * d.unsqueeze(-1)).view(m, k)
        y = ops.linear(torch.cat((x, x - xq)), self.packed, self.fmt.ggml_type, self.shape[0])
        return y[:m] + y[m:]

    def dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with W dequantized CHUNK_ELEMS floats at a time (float32, then x's dtype:
        float32 or bfloat16) into the GEMMs of ops.linear.mm_t; the result in x's dtype."""
        n, k = self.shape
        step = max(ROW_GROUP, CHUNK_ELEMS // k // ROW_GROUP * ROW_GROUP)
        if step >= n:
            return mm_t(x, self.dequantize().to(x.dtype))
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for r0 in range(0, n, step):       # chunks of the weight, not rows or blocks
            r1 = min(n, r0 + step)
            mm_t(x, self.dequantize(r0, r1).to(x.dtype), out=y[:, r0:r1])
        return y

    def dequantize(self, row0: int = 0, row1: Optional[int] = None) -> torch.Tensor:
        """Rows [row0, row1) as float32 [rows, K], bit-identical to gguf's dequantizer."""
        n, _ = self.shape
        row1 = n if row1 is None else row1
        if self.packed.is_cuda:
            return self.dequantize_rows(torch.arange(row0, row1, device=self.packed.device))
        ops = kernel.ops() if self.packed.device.type == "cpu" else None
        if ops is not None:
            return ops.dequantize(self.packed, self.fmt.ggml_type, n, row0, row1)
        g0, g1 = row0 // ROW_GROUP, -(-row1 // ROW_GROUP)       # the groups holding the rows
        blocks = packing.unpack_blocks(self.packed[g0:g1], (g1 - g0) * ROW_GROUP, self.fmt)
        rows = blocks[row0 - g0 * ROW_GROUP:row1 - g0 * ROW_GROUP]
        return packing.dequantize_blocks(rows.reshape(row1 - row0, -1, self.fmt.type_size),
                                         self.fmt).reshape(row1 - row0, self.shape[1])

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The given rows only, float32 [len(ids), K] (an embedding lookup): the C++ row
        decoder on CPU, else torch ops on the gathered blocks (any device); both gguf-exact."""
        ids = ids.reshape(-1).long()
        if self.packed.is_cuda:         # Triton; no host-side range check (CUDA graphs)
            from kvserve.ops.triton.quant import dequantize_rows
            return dequantize_rows(self.packed, self.fmt, *self.shape, ids.to(self.packed.device))
        ops = kernel.ops() if self.packed.device.type == "cpu" else None
        if ops is not None and ids.device.type == "cpu":
            try:
                return ops.dequantize_ids(self.packed, self.fmt.ggml_type, self.shape[0], ids)
            except RuntimeError as e:       # the op's own range check
                raise IndexError(f"row ids outside [0, {self.shape[0]})") from e
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
            raise IndexError(f"row ids outside [0, {self.shape[0]})")
        blocks = packing.unpack_rows(self.packed, ids, self.fmt)             # [R, nb, type_size]
        return packing.dequantize_blocks(blocks, self.fmt).reshape(ids.numel(), self.shape[1])

    def to(self, device: Union[str, torch.device]) -> "PackedQuantWeight":
        """The same blocks on `device` (the layout is the same on every device)."""
        return PackedQuantWeight(self.fmt, self.shape, self.packed.to(device))

    # ------------------------------------------------------------------ tensor parallelism
    def shard(self, dim: int, rank: int, world: int) -> "PackedQuantWeight":
        """This rank's 1/world of the weight along `dim` (0: output rows, column-parallel;
        1: input features, row-parallel), cut on block boundaries. A ValueError where the shape
        does not split evenly into whole rows (dim 0) or whole blocks (dim 1)."""
        n, k = self.shape
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        size = (n, k)[dim]
        if size % world:
            raise ValueError(f"{self.qtype} weight [{n}, {k}]: dim {dim} ({size}) does not "
                             f"split into {world} equal shards")
        part = size // world
        rows = self.raw_rows()
        if dim == 0:
            piece = rows[rank * part:(rank + 1) * part]
            return PackedQuantWeight.from_gguf(self.fmt.name, piece.contiguous(), (part, k))
        if dim != 1:
            raise ValueError(f"dim must be 0 or 1, got {dim}")
        bs = self.fmt.block_size
        if part % bs:
            raise ValueError(f"{self.qtype} weight [{n}, {k}]: {world} shards of {part} input "
                             f"features are not whole {bs}-weight blocks; this type cannot be "
                             f"split {world} ways along K")
        tb = part // bs * self.fmt.type_size
        piece = rows[:, rank * tb:(rank + 1) * tb]
        return PackedQuantWeight.from_gguf(self.fmt.name, piece.contiguous(), (n, part))

    def __repr__(self) -> str:
        return (f"PackedQuantWeight({self.qtype}, shape={list(self.shape)}, "
                f"{self.nbytes / 2**20:.2f} MiB)")


@dataclass
class QuantizedRows:
    """A GGUF tensor's raw blocks on their way into a packed weight: [N, row_bytes] uint8
    (a file view or a copy) holding an [N, K] weight of type `qtype`. The layers' weight
    loaders cut TP shards of it as of a tensor: `narrow` on rows, or on whole blocks of K."""
    qtype: str
    raw: Union[np.ndarray, torch.Tensor]
    shape: tuple[int, int]

    @staticmethod
    def from_file(qtype: str, rows: Union[np.ndarray, torch.Tensor],
                  shape: tuple[int, ...]) -> "QuantizedRows":
        """A file's raw rows of a KEPT_TYPES type: kept as they are (a file view), or rewritten
        (a copy) as the packed type TRANSCODED names (transcode.py)."""
        if qtype in TRANSCODED:
            qtype, rows = transcode(qtype, rows)
        return QuantizedRows(qtype, rows, (int(shape[0]), int(shape[1])))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedRows":
        n, k = self.shape
        if dim == 0:
            return QuantizedRows(self.qtype, self.raw[start:start + length], (length, k))
        fmt = block_format(self.qtype)
        if dim != 1 or start % fmt.block_size or length % fmt.block_size:
            raise ValueError(f"{self.qtype} weight [{n}, {k}]: a shard of input features "
                             f"[{start}, {start + length}) is not whole {fmt.block_size}-weight "
                             f"blocks; this tensor parallel split needs the weight dequantized "
                             f"(--quantization gguf-dequantized) or another tensor_parallel_size")
        b0, b1 = start // fmt.block_size * fmt.type_size, (start + length) // fmt.block_size
        return QuantizedRows(self.qtype, self.raw[:, b0:b1 * fmt.type_size], (n, length))

    def zero_padded(self, rows: int) -> "QuantizedRows":
        """`rows` rows, the added ones zero bytes (scales 0: they dequantize to 0)."""
        n, k = self.shape
        if rows == n:
            return self
        raw = np.zeros((rows, np.asarray(self.raw).shape[1]), dtype=np.uint8)
        raw[:n] = np.asarray(self.raw)
        return QuantizedRows(self.qtype, raw, (rows, k))

    @staticmethod
    def pack(parts: list["QuantizedRows"]) -> PackedQuantWeight:
        """One packed weight from row-wise parts of one type (a fused q|k|v, gate|up)."""
        raws = [np.asarray(p.raw) for p in parts]
        raw = raws[0] if len(raws) == 1 else np.concatenate(raws)
        rows = sum(p.shape[0] for p in parts)
        return PackedQuantWeight.from_gguf(parts[0].qtype, np.ascontiguousarray(raw),
                                           (rows, parts[0].shape[1]))
