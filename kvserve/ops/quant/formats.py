"""GGUF block formats kept packed: what one block holds, and how the kernels lay them out.

Every type quantizes a row of K weights in blocks along K. A block is `type_size` bytes for
`block_size` weights, stored as llama.cpp stores it (little-endian; `d` / `dmin` float16):

    Q8_0  32 w, 34 B   d, q[32] int8                                 w = d * q
    Q4_0  32 w, 18 B   d, nibbles[16] (low: w 0-15, high: w 16-31)   w = d * (q - 8)
    Q4_1  32 w, 20 B   d, m, nibbles[16]                             w = d * q + m
    Q5_0  32 w, 22 B   d, qh (32 high bits, u32), nibbles[16]        w = d * (q - 16)
    Q5_1  32 w, 24 B   d, m, qh, nibbles[16]                         w = d * q + m
    Q4_K 256 w, 144 B  d, dmin, scales[12] (8 x 6-bit scale + min), nibbles[128]
                       sub-block j of 32: w = d * sc_j * q - dmin * m_j
    Q5_K 256 w, 176 B  d, dmin, scales[12], qh[32], nibbles[128]    as Q4_K, q 5-bit
    Q6_K 256 w, 210 B  ql[128], qh[64], scales[16] int8, d          16-value groups g:
                                                                     w = d * sc_g * (q - 32)
    IQ4_NL 32 w, 18 B  d, nibbles[16] as Q4_0's                     w = d * IQ4_NL_VALUES[q]
    Q2_K 256 w, 84 B   scales[16] (low nibble sc, high m), qs[64] (Q6_K's qh layout), d, dmin
                       16-value groups g: w = d * sc_g * q - dmin * m_g, q 0..3
    Q3_K 256 w, 110 B  hmask[32] (Q5_K's qh layout), qs[64] (Q2_K's), scales[12] (16 x 6-bit), d
                       16-value groups g: w = d * (s_g - 32) * (q + 4 h - 4), q 2-bit, h 1-bit

The packed layout (packing.pack_blocks) takes ROW_GROUP = 8 rows at a time and, block by block,
interleaves their bytes field by field so that one 32-byte load holds 4 consecutive weights of
each of the 8 rows (one per 32-bit lane), as llama.cpp's repacked "x8" GEMV layouts do:

    packed [ceil(N / 8), K / block_size, 8 * type_size] uint8
    one group-block = each field of the block (BlockFormat.fields: offset, length, width) in
    turn, as [length / width][8 rows][width bytes]

so a field of 4-byte units (quants, high bits) is [unit][row][4] and a scale is [row][2].
Q4_K / Q5_K's 12 bytes of 6-bit scales and minimums (width 0 below) are stored decoded
instead: 8 scales [sub-block][row] and 8 minimums [pair][row][2], one byte each (128 bytes per
group-block where 96 held them: +2.8% for Q4_K, +2.3% for Q5_K), so that the kernel multiplies
them in with madd instead of unpacking 6-bit fields per row. Q3_K's 16 six-bit scales are
stored decoded the same way, as Q6_K's int8 scales (s - 32, [pair][row][2]; +3.6%), so that
Q3_K runs Q6_K's code with its 3 bits read from qs and hmask and an offset of 4.
The integer dot products then run lane-parallel: lane r accumulates row r (maddubs with x's 4
values broadcast), the scales of 8 rows are one float16 load, and no horizontal sum is
needed. The bytes are only moved, except Q5_0 / Q5_1's 32 high bits, which are reordered
(bit 4c + i -> byte i, bit c) so that each 4-weight chunk's bits are one shift away. Packing
is exactly invertible (unpack_blocks). Rows N..8*ceil(N/8)-1 are padding that no output reads.

Activations are quantized to int8 in blocks of 32 values, as llama.cpp's x86 code does for the
32-weight types (its "vec_dot_type"): Q8_0 (float16 scale) for Q4_0 / Q5_0 / Q8_0 / IQ4_NL, Q8_1
(plus fp16(d * sum q), which the minimum multiplies) for Q4_1 / Q5_1; near-ties between logits
then fall where llama.cpp's do on the same file. The K-quants take the same 32-value blocks with
a float32 scale (plus the sums of each 16 for their minimums and Q6_K's -32 offset), where
llama.cpp takes Q8_K (one scale per 256): measured on the demo's llama.cpp Q4_K_M file (its
K-quants are ffn_down, whose SiLU-gated input has outliers that one scale per 256 flattens),
perplexity over the test text went from 1.28% above the dequantized float32 path's to 0.4%
(llama.cpp itself: 0.5%). csrc/quant_linear.cpp and reference.quantize_activations have the
rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

# Output rows per interleaved group in the packed layout (and per kernel work item).
ROW_GROUP = 8
# A field of a block: (byte offset in the GGUF block, length, width of its interleaved unit);
# width 0: Q4_K / Q5_K's packed 6-bit scales, stored decoded in K_SCALES_BYTES per group-block.
Field = tuple[int, int, int]
K_SCALES_BYTES = 128
# IQ4_NL's weight values, indexed by the stored nibble (llama.cpp's kvalues_iq4nl, ggml-common.h)
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                          113], dtype=np.int8)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type."""
    name: str               # gguf.GGMLQuantizationType name
    ggml_type: int          # its enum value (what the C++ kernel takes as `qtype`)
    block_size: int         # weights per block
    type_size: int          # bytes per block
    act_block: int          # activation values per int8 block (32)
    act_sum_group: int      # activation values per stored int sum (32, or 16 for K-quants)
    fields: tuple[Field, ...]  # in packed order (see the module doc)
    permuted_high_bits: Optional[int] = None   # offset of Q5_0 / Q5_1's reordered u32

    @property
    def k_quant(self) -> bool:
        """A 256-weight super-block type (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)."""
        return self.block_size == 256

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    @property
    def group_block_bytes(self) -> int:
        """Bytes of one block of ROW_GROUP rows in the packed layout."""
        extra = sum(K_SCALES_BYTES - ROW_GROUP * length
                    for _, length, width in self.fields if width == 0)
        return ROW_GROUP * self.type_size + extra

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights (k a multiple of block_size)."""
        self.check_k(k)
        return k // self.block_size * self.type_size

    def check_k(self, k: int) -> None:
        if k <= 0 or k % self.block_size:
            raise ValueError(f"{self.name} rows hold {self.block_size}-weight blocks: a row of "
                             f"{k} weights is not a whole number of them.")


def _fmt(name: str, ggml_type: int, block_size: int, type_size: int, fields: tuple[Field, ...],
         permuted_high_bits: Optional[int] = None) -> BlockFormat:
    k_quant = block_size == 256
    assert sum(length for _, length, _ in fields) == type_size
    return BlockFormat(name, ggml_type, block_size, type_size, act_block=32,
                       act_sum_group=16 if k_quant else 32, fields=fields,
                       permuted_high_bits=permuted_high_bits)


_D, _M = (0, 2, 2), (2, 2, 2)
FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    _fmt("Q4_0", 2, 32, 18, (_D, (2, 16, 4))),
    _fmt("Q4_1", 3, 32, 20, (_D, _M, (4, 16, 4))),
    _fmt("Q5_0", 6, 32, 22, (_D, (2, 4, 4), (6, 16, 4)), permuted_high_bits=2),
    _fmt("Q5_1", 7, 32, 24, (_D, _M, (4, 4, 4), (8, 16, 4)), permuted_high_bits=4),
    _fmt("Q8_0", 8, 32, 34, (_D, (2, 32, 4))),
    _fmt("Q4_K", 12, 256, 144, (_D, _M, (4, 12, 0), (16, 128, 4))),
    _fmt("Q5_K", 13, 256, 176, (_D, _M, (4, 12, 0), (16, 32, 4), (48, 128, 4))),
    # d, the 16 int8 scales ([pair of groups][row][2]), ql, qh
    _fmt("Q6_K", 14, 256, 210, ((208, 2, 2), (192, 16, 2), (0, 128, 4), (128, 64, 4))),
    _fmt("IQ4_NL", 20, 32, 18, (_D, (2, 16, 4))),
    # d, dmin, the 16 scale bytes ([pair of groups][row][2], as Q6_K's), qs
    _fmt("Q2_K", 10, 256, 84, ((80, 2, 2), (82, 2, 2), (0, 16, 2), (16, 64, 4))),
    # d, the 16 scales decoded (as Q6_K's, [pair][row][2]), qs, hmask
    _fmt("Q3_K", 11, 256, 110, ((108, 2, 2), (96, 12, 0), (32, 64, 4), (0, 32, 4))),
)}
# Every format the kernels take: a file's tensors of these types stay packed as they are.
PACKED_TYPES = tuple(FORMATS)


def block_format(qtype: object) -> BlockFormat:
    """The format of a type given by name ("Q4_K"), gguf.GGMLQuantizationType, or enum value."""
    name = getattr(qtype, "name", qtype)
    if isinstance(name, int):
        name = next((f.name for f in FORMATS.values() if f.ggml_type == name), str(name))
    fmt = FORMATS.get(str(name).upper())
    if fmt is None:
        raise ValueError(f"GGUF type {name} is not kept packed; packed types: "
                         f"{', '.join(PACKED_TYPES)}.")
    return fmt
