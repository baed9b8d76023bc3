"""Malformed checkpoint files fail at load with a clear error naming the file and what is wrong,
before anything is allocated: safetensors files (truncated, a header length past the file, a
header that is not JSON, offsets outside the data or overlapping, a shape that does not match
its bytes, an absurd shape, an unknown dtype) and GGUF files whose metadata disagrees with their
tensors (an absurd layer count, a hidden size or head counts that do not fit)."""
from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any, Callable

import pytest

from kvserve.engine.arg_utils import EngineArgs
from kvserve.model.file_checks import check_safetensors_header
from tests.model.gguf_files import write_gguf

TINY = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20, multiprocessing=False)


def _read(path: str) -> tuple[dict[str, Any], bytes]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), f.read()


def _write(path: str, header: Any, data: bytes, header_len: int | None = None) -> None:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def _first_two(header: dict) -> tuple[str, str]:
    names = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][0])
    return names[0], names[1]


def _cases(header: dict, data: bytes) -> dict[str, tuple[Callable[[str], None], str]]:
    a, b = _first_two(header)

    def edited(fn: Callable[[dict], None]) -> Callable[[str], None]:
        def write(path: str) -> None:
            h = json.loads(json.dumps(header))
            fn(h)
            _write(path, h, data)
        return write

    return {
        "cut inside the data": (lambda p: _write(p, header, data[:len(data) // 2]),
                                "truncated"),
        "cut inside the header": (lambda p: open(p, "wb").write(
            struct.pack("<Q", 4096) + b'{"a": '), "header length 4096 is over the file"),
        "4 bytes": (lambda p: open(p, "wb").write(b"\x00\x01\x02\x03"), "truncated: 4 bytes"),
        "absurd header length": (lambda p: _write(p, header, data, header_len=1 << 60),
                                 "header length"),
        "header not JSON": (lambda p: _write(p, b"\xff\xfe not json at all", data),
                            "corrupt header"),
        "header not an object": (lambda p: _write(p, [1, 2, 3], data), "not an object"),
        "offset past the data": (edited(lambda h: h[a].update(data_offsets=[
            h[a]["data_offsets"][0], len(data) + 4096])), "truncated"),
        "overlapping tensors": (edited(lambda h: h[b].update(data_offsets=[
            h[b]["data_offsets"][0] - 4, h[b]["data_offsets"][1] - 4])), "overlap"),
        "shape does not match the bytes": (edited(lambda h: h[a].update(
            shape=[d * 2 for d in h[a]["shape"]])), "bytes of data"),
        "absurd shape": (edited(lambda h: h[a].update(shape=[1 << 40, 1 << 40])),
                         "bytes of data"),
        "negative dimension": (edited(lambda h: h[a].update(shape=[-1, 4])), "invalid shape"),
        "unknown dtype": (edited(lambda h: h[a].update(dtype="F128")), "unknown dtype"),
        "reversed offsets": (edited(lambda h: h[a].update(data_offsets=[8, 4])),
                             "invalid data_offsets"),
    }


def test_malformed_safetensors_headers_are_clear_errors(tiny_llama: str, tmp_path) -> None:
    header, data = _read(os.path.join(tiny_llama, "model.safetensors"))
    check_safetensors_header(os.path.join(tiny_llama, "model.safetensors"))   # the good one
    for name, (write, message) in _cases(header, data).items():
        path = str(tmp_path / (name.replace(" ", "_") + ".safetensors"))
        write(path)
        with pytest.raises(ValueError, match=message) as info:
            check_safetensors_header(path)
        assert path in str(info.value), (name, info.value)


def test_malformed_safetensors_fails_the_load_before_allocating(tiny_llama: str, tmp_path) -> None:
    """Through the real load path (LLM): the absurd shape (2^80 floats) is a ValueError from
    the header check, not an allocation attempt or a crash."""
    from kvserve import LLM

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    header, data = _read(str(ckpt / "model.safetensors"))
    _cases(header, data)["absurd shape"][0](str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors.*bytes of data"):
        LLM(str(ckpt), **TINY)


@pytest.mark.parametrize("override, message", [
    ({"num_hidden_layers": 64}, "block_count is 64 but the file has tensors for 2 layers"),
    ({"hidden_size": 4096}, "token_embd.weight has shape"),
    ({"num_key_value_heads": 3}, "not a multiple of 3 KV heads"),
    ({"intermediate_size": 1 << 30}, "ffn_up.weight has shape"),
])
def test_gguf_metadata_that_disagrees_with_its_tensors(tiny_llama: str, tmp_path,
                                                       override: dict, message: str) -> None:
    """The metadata is written from an edited config.json; the tensors are the real ones."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(override)
    (ckpt / "config.json").write_text(json.dumps(config))
    path = write_gguf(str(ckpt), str(tmp_path / "bad.gguf"), "F32", permute=False)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=path, **{k: v for k, v in TINY.items() if k != "multiprocessing"}
                   ).create_engine_config()
