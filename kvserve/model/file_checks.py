"""Checks of a safetensors file's header before any tensor is read: a truncated file, offsets
outside the data or overlapping, shapes that do not match their byte ranges, an absurd header
size. Each is a ValueError naming the file and the tensor, raised before anything is allocated
(the header alone is read; it is bounded in size before it is read).

The format: 8 bytes (little-endian u64) header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data; offsets count from the end of the header.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Iterable

# safetensors' own limit on the header (its Rust reader refuses larger ones).
MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8}


def check_safetensors_files(paths: Iterable[str]) -> list[str]:
    """Check every file (see the module docstring); returns the paths."""
    paths = list(paths)
    for path in paths:
        check_safetensors_header(path)
    return paths


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """The header's JSON and the file's data size (bytes after the header)."""
    size = os.path.getsize(path)
    if size < 8:
        raise ValueError(f"safetensors file {path!r} is truncated: {size} bytes, less than its "
                         f"8-byte header length.")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise ValueError(f"safetensors file {path!r} is corrupt or truncated: its header "
                             f"length {n} is over {'the file' if n > size - 8 else 'the limit'} "
                             f"({min(size - 8, MAX_HEADER_BYTES)} bytes).")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"safetensors file {path!r} has a corrupt header (not JSON: "
                         f"{e}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"safetensors file {path!r} has a corrupt header (not an object).")
    return header, size - 8 - n


def check_safetensors_header(path: str) -> None:
    header, data_size = read_safetensors_header(path)
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        spans.append(_check_tensor(path, name, info, data_size))
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"safetensors file {path!r} is corrupt: tensors {n0!r} and {n1!r} "
                             f"overlap (bytes {b0}-{e0} and {b1}-...).")


def _check_tensor(path: str, name: str, info: Any, data_size: int) -> tuple[int, int, str]:
    def bad(why: str) -> ValueError:
        return ValueError(f"safetensors file {path!r} is corrupt: tensor {name!r} {why}.")

    if not isinstance(info, dict):
        raise bad("has no dtype / shape / data_offsets entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if end > data_size:
        raise bad(f"ends at byte {end} of the data, but the file has {data_size} bytes of data "
                  f"(truncated?)")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != expected:
        raise bad(f"has shape {shape} of {dtype} ({expected} bytes) but {end - begin} bytes of "
                  f"data")
    return begin, end, name
