"""Parse a GGUF header (key/values and tensor directory) straight from the mapped bytes.

gguf-py's `GGUFReader` builds a numpy object per array element, which takes seconds for a
150k-token vocabulary; this reads numeric arrays in one `frombuffer` and strings in one pass.
Types, sizes and alignment rules are gguf-py's constants; tests check the result equals
`GGUFReader`'s on real files.
"""

from __future__ import annotations

import math
import struct

import gguf
import numpy as np

V = gguf.GGUFValueType
_SCALAR = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
           V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}


class HeaderError(ValueError):
    pass


MAX_ARRAY_DEPTH = 8  # llama.cpp writes flat arrays; deeper nesting is a corrupt or hostile file
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 2**63 - 1  # ggml's int64 element counts


_U64 = struct.Struct("<Q").unpack_from


class _Cursor:
    def __init__(self, data):
        # a memoryview: slicing a numpy mapping makes an array object per slice (a 248k-token
        # vocabulary's strings took 0.7 s of CPU; a memoryview slice is a fraction of that)
        self.data, self.pos = memoryview(data).cast("B"), 0

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise HeaderError(f"header ends at byte {len(self.data)}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def left(self) -> int:
        return len(self.data) - self.pos

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` length-prefixed strings in one tight loop (a vocabulary reads all of its at once)."""
        data, pos, end = self.data, self.pos, len(self.data)
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise HeaderError(f"header ends at byte {end}")
            (n,) = _U64(data, pos)
            pos += 8
            if n > end - pos:
                raise HeaderError(f"string of {n} bytes runs past the end of the file")
            append(str(data[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int, depth: int = 0):
        if kind == V.STRING:
            return self.string()
        if kind != V.ARRAY:
            if kind not in _SCALAR:
                raise HeaderError(f"unknown value type {kind}")
            value = self.take(_SCALAR[kind])
            return bool(value) if kind == V.BOOL else value
        if depth >= MAX_ARRAY_DEPTH:
            raise HeaderError(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item, count = self.take("<I"), self.take("<Q")
        if item not in _SCALAR and item not in (V.STRING, V.ARRAY):
            raise HeaderError(f"array of unknown value type {item}")
        # every item takes at least its fixed part, so a count the bytes left cannot hold is a lie
        least = 8 if item == V.STRING else 12 if item == V.ARRAY else struct.calcsize(_SCALAR[item])
        if count * least > self.left():
            raise HeaderError(f"array of {count} items runs past the end of the file")
        if item == V.STRING:
            return self.strings(count)
        if item == V.ARRAY:
            return [self.value(item, depth + 1) for _ in range(count)]
        dtype = np.dtype(_SCALAR[item].replace("?", "b1"))
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
    if n_kv * 12 > c.left() or n_tensors * 28 > c.left():  # a key/value or a tensor entry takes that much at least
        raise HeaderError(f"{n_kv} key/values and {n_tensors} tensors do not fit in the file")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        if key in meta:
            raise HeaderError(f"metadata key {key!r} appears twice")
        meta[key] = c.value(c.take("<I"))
    alignment = meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise HeaderError(f"general.alignment = {alignment!r} is not a positive power of two")
    tensors, names = [], set()
    for _ in range(n_tensors):
        name = c.string()
        if name in names:
            raise HeaderError(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = c.take("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise HeaderError(f"tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
        dims = tuple(c.take("<Q") for _ in range(n_dims))
        if math.prod(dims) > MAX_ELEMENTS:
            raise HeaderError(f"tensor {name!r} has dims {list(dims)}, more elements than an int64 holds")
        type_id, offset = c.take("<I"), c.take("<Q")
        if offset % alignment:
            raise HeaderError(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment "
                              f"{alignment}")
        tensors.append((name, dims, type_id, offset))
    start = c.pos + (-c.pos % alignment)
    return meta, tensors, start
