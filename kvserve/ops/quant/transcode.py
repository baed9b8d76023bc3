"""GGUF types with no kernels of their own, rewritten at load as a type that has them. Q3_K's
rewrite is exact (every weight dequantizes to the same number; gguf.quants is the reference in
the tests), IQ4_XS's rounds one product to float16:

    Q3_K   -> Q3_K4  w = d * (s - 32) * q,  q in -4..3 and s 6-bit, per 16 weights: Q3_K4's
                     (formats.py: Q6_K's block without its high bits) w = d * sc * (q4 - 4)
                     with sc = s - 32 (int8) and q4 = q + 4 (a nibble)
    IQ4_XS -> IQ4_NL w = d * (s - 32) * table[nibble], s 6-bit per 32 weights: IQ4_NL's
                     w = d' * table[nibble] (the same nibbles) with d' = float16(d * (s - 32)),
                     within 2^-11 of the product (relative; IQ4_NL has one float16 scale a
                     32-weight block)

Q3_K_M / Q3_K_L / Q3_K_S files are mostly Q3_K (llama.cpp stores such tensors with rows that
are not whole 256-weight blocks, SmolLM2's 576, as Q4_0); IQ4_XS files keep those rows as
IQ4_NL, which has kernels of its own. The rewritten tensors take 4.56 / 4.5 bits a weight where
the file has 3.44 / 4.25: Q3_K 1.33x the memory (its 2-bit and 1-bit fields as one nibble: the
kernels read whole nibbles), IQ4_XS 1.06x. The other types no kernel covers (the IQ1 / IQ2 /
IQ3 types) the loader dequantizes.
"""
from __future__ import annotations

import numpy as np

TRANSCODED: dict[str, str] = {"Q3_K": "Q3_K4", "IQ4_XS": "IQ4_NL"}


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


def _q3_k_as_q3_k4(blocks: np.ndarray) -> np.ndarray:
    # Q3_K block: hmask[32], qs[64], scales[12], d (fp16). Value e = 128 h + 32 s + l takes
    # bits 2s..2s+1 of qs[32 h + l] and, inverted, bit e // 32 of hmask[e % 32] as -4.
    n = blocks.shape[0]
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    low = ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 256)
    high = ((hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1)
    q4 = low + (high.reshape(n, 256) << 2)             # q + 4, q = low - 4 (1 - bit)
    # Scale j (6 bits): its low 4 in nibble j // 8 of scales[j % 8], its high 2 at bits
    # 2 (j // 4) of scales[8 + j % 4].
    lo = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1))
    hi = (scales[:, 8:].reshape(n, 1, 4) >> shifts.reshape(1, 4, 1))
    s = (lo.reshape(n, 16) & 15) | ((hi.reshape(n, 16) & 3) << 4)
    out = np.empty((n, 146), dtype=np.uint8)
    out[:, :128] = _q6_k_low_nibbles(q4)
    out[:, 128:144] = (s.astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    out[:, 144:] = d
    return out


def _q6_k_low_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 256] 4-bit values in weight order -> Q6_K's ql[128] (Q3_K4's quants): value 128 h +
    32 j + l in ql[64 h + 32 (j % 2) + l], its low nibble for j < 2, its high one for j >= 2."""
    n = q.shape[0]
    v = q.reshape(n, 2, 4, 32)
    return (v[:, :, :2] | (v[:, :, 2:] << 4)).reshape(n, 128)


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
_REWRITES = {"Q3_K": (_q3_k_as_q3_k4, 110, 146), "IQ4_XS": (_iq4_xs_as_iq4_nl, 136, 8 * 18)}
_CHUNK_BLOCKS = 1 << 16
