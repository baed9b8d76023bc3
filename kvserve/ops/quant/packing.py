"""Repacking GGUF rows into the kernels' layout, and dequantizing blocks with torch.

    raw     [N, K / block_size * type_size] uint8   rows of blocks, as gguf's GGUFReader gives
    packed  [ceil(N / 8), K / block_size, group_block_bytes] uint8   8 rows interleaved
            (formats.py: 8 * type_size bytes, Q3_K / Q4_K / Q5_K 32 more for decoded scales)

dequantize_blocks is the portable dequantizer (torch ops, any device): the fallback where no
C++ kernel is built, and the embedding gather. It does gguf.quants' float32 operations in the
same order, so it gives the same bits (tests/ops/test_quant_linear.py checks that).
"""
from __future__ import annotations

import warnings
from typing import Union

import numpy as np
import torch

from kvserve.ops.quant.formats import IQ4_NL_VALUES, K_SCALES_BYTES, ROW_GROUP, BlockFormat

ArrayLike = Union[np.ndarray, torch.Tensor]


def as_raw_rows(raw: ArrayLike, fmt: BlockFormat, shape: tuple[int, int]) -> torch.Tensor:
    """The raw bytes of an [N, K] tensor of type `fmt` as a uint8 tensor [N, row_bytes]
    (a view of a numpy memmap where possible: no copy until pack_blocks). Checks the size."""
    n, k = shape
    row_bytes = fmt.row_bytes(k)
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():    # GGUFReader's memmap is read-only; only read here
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8))
    else:
        t = raw
    if t.dtype != torch.uint8 or t.numel() != n * row_bytes:
        raise ValueError(f"{fmt.name} tensor of shape [{n}, {k}] needs {n * row_bytes} bytes "
                         f"of blocks, got {t.numel()} ({t.dtype}).")
    return t.reshape(n, row_bytes)


def _high_bit_order() -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 / Q5_1's u32 of high bits: packed bit 8i + c is GGUF bit 4c + i (weight 4c + i, the
    i-th of chunk c), so chunk c's 4 bits are bit c of the row's 4 bytes. (perm, inverse)."""
    perm = torch.tensor([4 * c + i for i in range(4) for c in range(8)])
    return perm, torch.argsort(perm)


def _reorder_bits(qh: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian u32) -> the same with bit j taken from bit order[j]."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((qh.unsqueeze(-1) >> shifts) & 1).reshape(*qh.shape[:-1], 32)[..., order]
    return (bits.reshape(*qh.shape[:-1], 4, 8) << shifts).sum(-1, dtype=torch.uint8)


def _k_scales_decoded(sc12: torch.Tensor) -> torch.Tensor:
    """[G, 8 rows, nb, 12] packed 6-bit scales / mins -> [G, nb, 128]: scales [j][row], then
    mins [j // 2][row][j % 2]."""
    g, r, nb, _ = sc12.shape
    sc, mn = (t.to(torch.uint8) for t in _scale_min_k4(sc12))   # [G, 8, nb, 8] each
    scales = sc.permute(0, 2, 3, 1).reshape(g, nb, 64)
    mins = mn.reshape(g, r, nb, 4, 2).permute(0, 2, 3, 1, 4).reshape(g, nb, 64)
    return torch.cat((scales, mins), dim=-1)


def _k_scales_packed(dec: torch.Tensor) -> torch.Tensor:
    """_k_scales_decoded's inverse: [G, nb, 128] -> [G, 8 rows, nb, 12]."""
    g, nb, _ = dec.shape
    sc = dec[..., :64].reshape(g, nb, 8, ROW_GROUP).permute(0, 3, 1, 2)     # [G, 8, nb, j]
    mn = dec[..., 64:].reshape(g, nb, 4, ROW_GROUP, 2).permute(0, 3, 1, 2, 4).reshape(
        g, ROW_GROUP, nb, 8)
    lo = (sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6)
    mid = (mn[..., :4] & 0x3F) | ((mn[..., 4:] >> 4) << 6)
    hi = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return torch.cat((lo, mid, hi), dim=-1)


def _q3_scales(sc12: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 scale bytes [..., 12] -> its 16 scales minus 32 [..., 16] int16: scale j's
    low 4 bits are nibble j // 8 of byte j % 8, its high 2 bits 2 (j // 4) of byte 8 + j % 4."""
    lo = torch.cat((sc12[..., :8] & 15, sc12[..., :8] >> 4), dim=-1)
    hi = torch.cat([(sc12[..., 8:12] >> (2 * k)) & 3 for k in range(4)], dim=-1)
    return (lo | (hi << 4)).to(torch.int16) - 32


def _q3_scales_decoded(sc12: torch.Tensor) -> torch.Tensor:
    """[G, 8 rows, nb, 12] Q3_K scales -> [G, nb, 128]: int8 s - 32 [pair][row][2], as Q6_K's."""
    g, r, nb, _ = sc12.shape
    s8 = _q3_scales(sc12).to(torch.int8).view(torch.uint8)          # [G, 8, nb, 16]
    return s8.reshape(g, r, nb, 8, 2).permute(0, 2, 3, 1, 4).reshape(g, nb, 128)


def _q3_scales_packed(dec: torch.Tensor) -> torch.Tensor:
    """_q3_scales_decoded's inverse: [G, nb, 128] -> [G, 8 rows, nb, 12]."""
    g, nb, _ = dec.shape
    s = dec.reshape(g, nb, 8, ROW_GROUP, 2).permute(0, 3, 1, 2, 4).reshape(g, ROW_GROUP, nb, 16)
    u = (s.contiguous().view(torch.int8).to(torch.int16) + 32).to(torch.uint8)
    low = (u[..., :8] & 15) | ((u[..., 8:] & 15) << 4)
    high = ((u[..., 0:4] >> 4) & 3) | (((u[..., 4:8] >> 4) & 3) << 2) | \
        (((u[..., 8:12] >> 4) & 3) << 4) | (((u[..., 12:16] >> 4) & 3) << 6)
    return torch.cat((low, high), dim=-1)


# The 12 bytes of 6-bit scales (a width-0 field) stored decoded: (decode, encode) per type.
_DECODED_SCALES = {"Q4_K": (_k_scales_decoded, _k_scales_packed),
                   "Q5_K": (_k_scales_decoded, _k_scales_packed),
                   "Q3_K": (_q3_scales_decoded, _q3_scales_packed)}


def pack_blocks(rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[N, row_bytes] uint8 -> packed [ceil(N/8), nb, 8 * type_size] (formats.py); padding rows
    are zero blocks (a zero scale: they dequantize to 0)."""
    n, row_bytes = rows.shape
    nb, ts, r = row_bytes // fmt.type_size, fmt.type_size, ROW_GROUP
    groups = -(-n // r)
    blocks = torch.zeros(groups * r, nb, ts, dtype=torch.uint8)
    blocks[:n] = rows.reshape(n, nb, ts)
    if fmt.permuted_high_bits is not None:
        o = fmt.permuted_high_bits
        blocks[:n, :, o:o + 4] = _reorder_bits(blocks[:n, :, o:o + 4], _high_bit_order()[0])
    blocks = blocks.view(groups, r, nb, ts)
    parts = [_DECODED_SCALES[fmt.name][0](blocks[..., off:off + length]) if width == 0 else
             blocks[..., off:off + length].reshape(groups, r, nb, length // width, width)
             .permute(0, 2, 3, 1, 4).reshape(groups, nb, r * length)
             for off, length, width in fmt.fields]
    return torch.cat(parts, dim=-1).contiguous()


def _unpack_groups(packed: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[G, nb, 8 * type_size] -> the GGUF blocks [G, 8, nb, type_size]."""
    g, nb, _ = packed.shape
    r = ROW_GROUP
    blocks = torch.empty(g, r, nb, fmt.type_size, dtype=torch.uint8, device=packed.device)
    pos = 0
    for off, length, width in fmt.fields:
        if width == 0:
            blocks[..., off:off + length] = _DECODED_SCALES[fmt.name][1](
                packed[..., pos:pos + K_SCALES_BYTES])
            pos += K_SCALES_BYTES
            continue
        blocks[..., off:off + length] = (packed[..., pos:pos + r * length]
                                         .reshape(g, nb, length // width, r, width)
                                         .permute(0, 3, 1, 2, 4).reshape(g, r, nb, length))
        pos += r * length
    if fmt.permuted_high_bits is not None:
        o = fmt.permuted_high_bits
        blocks[..., o:o + 4] = _reorder_bits(blocks[..., o:o + 4],
                                             _high_bit_order()[1].to(packed.device))
    return blocks


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The GGUF blocks of the given output rows: [len(rows), nb, type_size] uint8."""
    groups = _unpack_groups(packed[rows // ROW_GROUP], fmt)     # [R, 8, nb, ts]
    return groups[torch.arange(rows.numel(), device=rows.device), rows % ROW_GROUP]


def unpack_blocks(packed: torch.Tensor, n: int, fmt: BlockFormat) -> torch.Tensor:
    """pack_blocks' inverse: [N, row_bytes] uint8 (a copy, padding dropped)."""
    blocks = _unpack_groups(packed, fmt)
    g, r, nb, ts = blocks.shape
    return blocks.reshape(g * r, nb * ts)[:n].contiguous()


# ------------------------------------------------------------------- torch dequantization

def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 * c] bytes -> [..., 2, 16 * c] (low nibbles, then high nibbles)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(qh: torch.Tensor, nbits: int) -> torch.Tensor:
    """[..., b] bytes -> [..., nbits, b]: bit i of every byte (for Q5_K's qh)."""
    shifts = torch.arange(nbits, dtype=torch.uint8, device=qh.device).view(nbits, 1)
    return (qh.unsqueeze(-2) >> shifts) & 1


def _qh32(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes of a little-endian u32 -> [..., 32] bits (bit j: weight j's fifth bit)."""
    return _bits(qh, 8).transpose(-1, -2).reshape(*qh.shape[:-1], 32)


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> (8 scales, 8 mins), 6-bit each (get_scale_min_k4)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales.float(), mins.float()


def dequantize_blocks(blocks: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[..., type_size] uint8 blocks -> [..., block_size] float32, bit-identical to
    gguf.quants.dequantize."""
    shape = blocks.shape[:-1]
    b = blocks.reshape(-1, fmt.type_size)
    out = _DEQUANT[fmt.name](b)
    return out.reshape(*shape, fmt.block_size)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, 0:2]).unsqueeze(-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).reshape(-1, 32).to(torch.int8) - 8
    return _f16(b[:, 0:2]).unsqueeze(-1) * q.float()


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    table = torch.from_numpy(IQ4_NL_VALUES).to(b.device).float()
    q = _nibbles(b[:, 2:]).reshape(-1, 32).long()
    return _f16(b[:, 0:2]).unsqueeze(-1) * table[q]


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:]).reshape(-1, 32).float()
    return _f16(b[:, 0:2]).unsqueeze(-1) * q + _f16(b[:, 2:4]).unsqueeze(-1)


def _q5(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    return _nibbles(ql).reshape(-1, 32) | (_qh32(qh) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _q5(b[:, 6:], b[:, 2:6]).to(torch.int8) - 16
    return _f16(b[:, 0:2]).unsqueeze(-1) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _q5(b[:, 8:], b[:, 4:8]).float()
    return _f16(b[:, 0:2]).unsqueeze(-1) * q + _f16(b[:, 2:4]).unsqueeze(-1)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, 0:2]).unsqueeze(-1) * sc).unsqueeze(-1)        # [nb, 8, 1]
    dm = (_f16(b[:, 2:4]).unsqueeze(-1) * mn).unsqueeze(-1)
    return d, dm


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(b)
    q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32).float()
    return (d * q - dm).reshape(-1, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    d, dm = _k_scales(b)
    ql = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    qh = _bits(b[:, 16:48], 8)                                     # [nb, 8, 32]
    return (d * (ql | (qh << 4)).float() - dm).reshape(-1, 256)


def _two_bit(qs: torch.Tensor) -> torch.Tensor:
    """[nb, 64] bytes of 2-bit fields (Q6_K's qh, Q2_K's qs) -> [nb, 8, 32] in weight order:
    weight 128 h + 32 j + l at bits 2j of byte 32 h + l."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 8, 32)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = _nibbles(b[:, 0:128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    qh = _two_bit(b[:, 128:192])
    return _q6_like((ql | (qh << 4)).to(torch.int8) - 32, b[:, 192:208], b[:, 208:210])


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    q = _two_bit(b[:, 16:80]).reshape(-1, 16, 16).float()
    sc = b[:, 0:16]
    dl = (_f16(b[:, 80:82]).unsqueeze(-1) * (sc & 0xF).float()).unsqueeze(-1)
    ml = (_f16(b[:, 82:84]).unsqueeze(-1) * (sc >> 4).float()).unsqueeze(-1)
    return (dl * q - ml).reshape(-1, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # weight 128 h + 32 j + l: bits 2j of qs[32 h + l], plus 4 x bit 4h + j of hmask[l]
    q = _two_bit(b[:, 32:96]) | (_bits(b[:, 0:32], 8) << 2)
    sc = _q3_scales(b[:, 96:108]).to(torch.int8).view(torch.uint8)
    return _q6_like(q.to(torch.int8) - 4, sc, b[:, 108:110])


def _q6_like(q: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """w = d * sc_g * q per 16-weight group g (Q6_K, Q3_K): q [nb, 8, 32] int8 (offset taken
    off), scales [nb, 16] int8 bytes, d [nb, 2] float16 bytes."""
    sc = scales.contiguous().view(torch.int8).float()
    dd = (_f16(d).unsqueeze(-1) * sc).reshape(-1, 16, 1)
    return (dd * q.reshape(-1, 16, 16).float()).reshape(-1, 256)


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "Q3_K": _q3_k,
            "Q2_K": _q2_k}
