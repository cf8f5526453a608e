"""Parse a GGUF header (key/values and tensor directory) straight from the mapped bytes.

gguf-py's `GGUFReader` builds a numpy object per array element, which takes seconds for a
150k-token vocabulary; this reads numeric arrays in one `frombuffer` and strings in one pass.
Types, sizes and alignment rules are gguf-py's constants; tests check the result equals
`GGUFReader`'s on real files.
"""

from __future__ import annotations

import struct

import gguf
import numpy as np

V = gguf.GGUFValueType
_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


class HeaderError(ValueError):
    pass


class _Cursor:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise HeaderError(f"header ends at byte {len(self.data)}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise HeaderError(f"string of {n} bytes runs past the end of the file")
        self.pos += n
        return bytes(self.data[self.pos - n: self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == V.STRING:
            return self.string()
        if kind != V.ARRAY:
            if kind not in _SCALAR:
                raise HeaderError(f"unknown value type {kind}")
            value = self.take(_SCALAR[kind])
            return bool(value) if kind == V.BOOL else value
        item, count = self.take("<I"), self.take("<Q")
        if item in (V.STRING, V.ARRAY):
            return [self.value(item) for _ in range(count)]
        dtype = np.dtype(_SCALAR[item].replace("?", "b1"))
        if self.pos + count * dtype.itemsize > len(self.data):
            raise HeaderError("array runs past the end of the file")
        out = np.frombuffer(self.data, dtype, count, self.pos).tolist()
        self.pos += count * dtype.itemsize
        return out


def parse_header(data) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]], int]:
    """-> (metadata, [(name, ne dims innermost first, ggml type, offset in data section)], data start)."""
    c = _Cursor(data)
    if c.take("<I") != gguf.GGUF_MAGIC:
        raise HeaderError("bad magic")
    version = c.take("<I")
    if version not in (2, 3):
        raise HeaderError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = c.take("<Q"), c.take("<Q")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.take("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
        tensors.append((name, dims, c.take("<I"), c.take("<Q")))
    alignment = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    start = c.pos + (-c.pos % alignment)
    return meta, tensors, start
