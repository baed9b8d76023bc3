"""GGUF types with no kernels of their own, rewritten at load as a type that has them. IQ4_XS's
rewrite rounds one product to float16 (gguf.quants is the reference in the tests):

    IQ4_XS -> IQ4_NL w = d * (s - 32) * table[nibble], s 6-bit per 32 weights: IQ4_NL's
                     w = d' * table[nibble] (the same nibbles) with d' = float16(d * (s - 32)),
                     within 2^-11 of the product (relative; IQ4_NL has one float16 scale a
                     32-weight block)

IQ4_XS files keep rows that are not whole 256-weight blocks (SmolLM2's 576) as IQ4_NL, which
has kernels of its own. The rewritten tensors take 4.5 bits a weight where the file has 4.25
(1.06x the memory). The other types no kernel covers (the IQ1 / IQ2 / IQ3 types) the loader
dequantizes.
"""
from __future__ import annotations

import numpy as np

TRANSCODED: dict[str, str] = {"IQ4_XS": "IQ4_NL"}


def transcode(qtype: str, rows: np.ndarray) -> tuple[str, np.ndarray]:
    """[N, row_bytes] uint8 rows of `qtype` blocks -> (the target type, its [N, row_bytes']
    uint8 rows), a new array holding the same weights."""
    rewrite = _REWRITES.get(qtype)
    if rewrite is None:
        raise ValueError(f"GGUF type {qtype} has no rewrite into a packed type; rewritten "
                         f"types: {', '.join(TRANSCODED)}.")
    fn, size, out_size = rewrite
    rows = np.asarray(rows).view(np.uint8)
    n = rows.shape[0]
    per_row = rows.shape[1] // size
    out = np.empty((n, per_row * out_size), dtype=np.uint8)
    # Rows a chunk: the temporaries (a few bytes a weight) stay ~100 MB on a large tensor.
    step = max(1, _CHUNK_BLOCKS // max(per_row, 1))
    for r in range(0, n, step):
        out[r:r + step] = fn(rows[r:r + step].reshape(-1, size)).reshape(-1, out.shape[1])
    return TRANSCODED[qtype], out


def _iq4_xs_as_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    # IQ4_XS block of 256: d (fp16), scales_h (u16: the high 2 bits of scale j at bits 2j),
    # scales_l[4] (the low 4 bits of scale j in nibble j % 2 of byte j // 2), then per 32
    # weights 16 bytes of nibbles as IQ4_NL's.
    n = blocks.shape[0]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    high = (blocks[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = (blocks[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)).reshape(n, 8) & 15
    s = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
    scale = (d * s).astype(np.float16).reshape(-1, 1).view(np.uint8)    # [n * 8, 2]
    return np.concatenate([scale, blocks[:, 8:].reshape(n * 8, 16)], axis=1).reshape(n, -1)


# type -> (the rewrite of [blocks, bytes], its block bytes, the target's)
_REWRITES = {"IQ4_XS": (_iq4_xs_as_iq4_nl, 136, 8 * 18)}
_CHUNK_BLOCKS = 1 << 16
