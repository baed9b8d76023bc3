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

The packed layout (pack_blocks) keeps every block's bytes as they are and interleaves rows by
ROW_GROUP: [ceil(N / 4), K / block_size, 4, type_size]. A small-batch kernel then reads one
sequential stream per group of 4 output rows (4 interleaved row streams read below one plain
stream, see csrc/linear.cpp "Tiled bf16 weights"), and a block is found by arithmetic alone.
Rows N..4*ceil(N/4)-1 are padding that no output reads.

Activations are quantized per block to int8 as llama.cpp does for these weights ("the vec_dot
type"): Q8_0-style 32-blocks for the 32-blocks (with each block's sum, which the Q4_1 / Q5_1
minimum multiplies) and Q8_K-style 256-blocks for the K-quants (with sums of each 16, which
the K-quants' minimums and Q6_K's -32 offset multiply). Here each block's scale is float32
(d = amax / 127, q = round-half-even(x / d)) rather than llama.cpp's float16 / signed-max
variants: one rule for both, and exactly reproducible (reference.quantize_activations).
"""
from __future__ import annotations

from dataclasses import dataclass

# Output rows per interleaved group in the packed layout (and per kernel work item).
ROW_GROUP = 4


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type."""
    name: str               # gguf.GGMLQuantizationType name
    ggml_type: int          # its enum value (what the C++ kernel takes as `qtype`)
    block_size: int         # weights per block
    type_size: int          # bytes per block
    act_block: int          # activation values per int8 block (32, or 256 for K-quants)
    act_sum_group: int      # activation values per stored int sum (32, or 16 for K-quants)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k weights (k a multiple of block_size)."""
        self.check_k(k)
        return k // self.block_size * self.type_size

    def check_k(self, k: int) -> None:
        if k <= 0 or k % self.block_size:
            raise ValueError(f"{self.name} rows hold {self.block_size}-weight blocks: a row of "
                             f"{k} weights is not a whole number of them.")


def _fmt(name: str, ggml_type: int, block_size: int, type_size: int) -> BlockFormat:
    k_quant = block_size == 256
    return BlockFormat(name, ggml_type, block_size, type_size,
                       act_block=256 if k_quant else 32, act_sum_group=16 if k_quant else 32)


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    _fmt("Q4_0", 2, 32, 18),
    _fmt("Q4_1", 3, 32, 20),
    _fmt("Q5_0", 6, 32, 22),
    _fmt("Q5_1", 7, 32, 24),
    _fmt("Q8_0", 8, 32, 34),
    _fmt("Q4_K", 12, 256, 144),
    _fmt("Q5_K", 13, 256, 176),
    _fmt("Q6_K", 14, 256, 210),
)}
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
