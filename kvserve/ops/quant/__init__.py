"""GGUF block-quantized weights kept packed: formats, repacking, kernels and the weight type.

    formats.py    the block formats (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL) and the layout
    packing.py    raw GGUF rows -> the kernels' interleaved layout; torch dequantization
    transcode.py  IQ4_XS rows rewritten as IQ4_NL ones at load
    kernel.py     the compiled kernels (csrc/quant_linear.cpp)
    weight.py     PackedQuantWeight: from_gguf, matmul, dequantize_rows, shard
    reference.py  float64 / gguf references for tests and benchmarks
"""
from kvserve.ops.quant.formats import (FORMATS, PACKED_TYPES, ROW_GROUP, BlockFormat,
                                       block_format)
from kvserve.ops.quant.transcode import TRANSCODED
from kvserve.ops.quant.weight import PackedQuantWeight

# The GGUF types a file's matrices stay packed in: packed as they are, or rewritten first.
KEPT_TYPES = (*PACKED_TYPES, *TRANSCODED)

__all__ = ["FORMATS", "KEPT_TYPES", "PACKED_TYPES", "ROW_GROUP",
           "TRANSCODED", "BlockFormat", "PackedQuantWeight", "block_format"]
