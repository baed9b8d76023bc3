"""msgpack (msgspec) encoding for frontend <-> engine core messages.

Tensors and numpy arrays are not turned into lists: an array becomes a msgpack extension
whose body is a small header (dtype, shape, data) and whose data is either

- the raw bytes, inline, for small arrays (below `size_threshold`), or
- an index into the list of *auxiliary buffers* that `encode` returns next to the main
  msgpack buffer. Those buffers are views of the array's own memory: sent as extra ZMQ frames
  with `copy=False` they are never copied on the way out, and on the way in the array is
  built straight on the received frame's memory.

    encode(obj) -> [main msgpack bytes, aux_0, aux_1, ...]     (one ZMQ frame each)
    decode([main, aux_0, aux_1, ...]) -> obj

The extension hook works for fields typed `Any` (utility results) as well as for fields typed
`torch.Tensor` / `np.ndarray`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import msgspec
import numpy as np
import torch

# Extension type codes (0..127 are the application's).
_EXT_TORCH = 1
_EXT_NUMPY = 2

# Arrays at least this large travel as their own buffer; smaller ones are inlined.
DEFAULT_SIZE_THRESHOLD = 256

Bytes = Union[bytes, bytearray, memoryview]


def _buffer_of(b: Any) -> Any:
    # A zmq.Frame (recv with copy=False) exposes its memory as .buffer; keep this module free
    # of a zmq import by duck typing.
    return b.buffer if hasattr(b, "buffer") and not isinstance(b, memoryview) else b


class MsgpackEncoder:
    """Not thread-safe: use one encoder per thread."""

    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD) -> None:
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: Optional[list[Bytes]] = None

    def encode(self, obj: Any) -> list[Bytes]:
        """[main buffer, *auxiliary buffers]; send them as one multipart message."""
        bufs: list[Bytes] = [b""]
        self._aux = bufs
        try:
            bufs[0] = self._encoder.encode(obj)
            return bufs
        finally:
            self._aux = None

    def encode_into(self, obj: Any, buf: bytearray) -> list[Bytes]:
        """Like encode, reusing `buf` for the main buffer (saves an allocation per message)."""
        bufs: list[Bytes] = [buf]
        self._aux = bufs
        try:
            self._encoder.encode_into(obj, buf)
            return bufs
        finally:
            self._aux = None

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            # Byte view: also covers dtypes numpy lacks (bfloat16).
            raw = t.reshape(-1).view(torch.uint8).numpy()
            return msgspec.msgpack.Ext(_EXT_TORCH, self._header(dtype, list(t.shape), raw))
        if isinstance(obj, np.ndarray) and obj.dtype.kind not in "OV":
            arr = np.ascontiguousarray(obj)
            raw = arr.reshape(-1).view(np.uint8)
            return msgspec.msgpack.Ext(_EXT_NUMPY, self._header(arr.dtype.str, list(arr.shape), raw))
        if isinstance(obj, np.generic):
            return obj.item()
        raise NotImplementedError(f"Objects of type {type(obj).__name__} cannot be serialized.")

    def _header(self, dtype: str, shape: list[int], raw: np.ndarray) -> bytes:
        data: Union[int, bytes]
        if self._aux is not None and raw.nbytes >= self.size_threshold:
            data = len(self._aux)
            self._aux.append(memoryview(raw))    # a view: no copy
        else:
            data = raw.tobytes()
        # A separate (stateless) encode: the hook runs inside self._encoder.encode.
        return msgspec.msgpack.encode((dtype, shape, data))


class MsgpackDecoder:
    """Decodes what MsgpackEncoder produced, optionally into a type (`msgspec` type spec)."""

    def __init__(self, t: Any = None) -> None:
        kwargs: dict[str, Any] = dict(ext_hook=self._ext_hook, dec_hook=self._dec_hook)
        self._decoder = (msgspec.msgpack.Decoder(t, **kwargs) if t is not None
                         else msgspec.msgpack.Decoder(**kwargs))
        self._aux: Sequence[Any] = ()

    def decode(self, bufs: Union[Bytes, Sequence[Any]]) -> Any:
        if isinstance(bufs, (bytes, bytearray, memoryview)) or hasattr(bufs, "buffer"):
            return self._decoder.decode(_buffer_of(bufs))
        self._aux = bufs
        try:
            return self._decoder.decode(_buffer_of(bufs[0]))
        finally:
            self._aux = ()

    def _payload(self, data: Union[int, bytes]) -> Any:
        if isinstance(data, int):
            buf = _buffer_of(self._aux[data])
            # torch.frombuffer needs writable memory; received zmq frames are, but an
            # in-memory bytes object is not.
            return bytearray(buf) if isinstance(buf, bytes) else buf
        return bytearray(data)      # small inline array: one small copy

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (_EXT_TORCH, _EXT_NUMPY):
            raise NotImplementedError(f"Unknown msgpack extension type {code}.")
        dtype, shape, payload = msgspec.msgpack.decode(data)
        buf = self._payload(payload)
        if code == _EXT_NUMPY:
            return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        torch_dtype = getattr(torch, dtype)
        if len(buf) == 0:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype).reshape(shape)

    @staticmethod
    def _dec_hook(t: type, obj: Any) -> Any:
        # Fields typed torch.Tensor / np.ndarray: the ext hook already built the object.
        if isinstance(t, type) and isinstance(obj, t):
            return obj
        raise NotImplementedError(f"Cannot decode {type(obj).__name__} as {t}.")
