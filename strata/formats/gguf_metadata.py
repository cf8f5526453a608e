"""GGUF key/value metadata as plain Python values.

`gguf.GGUFReader` keeps every value as numpy views into the memory-mapped file, one view per array
element. Callers (tokenizer, config reader) want `str`, `int`, `float`, `bool` and lists, and a
150k-token vocabulary must not cost a Python call per element on the numeric side, so arrays are
read straight from the file bytes: numeric arrays with one `np.frombuffer`, string arrays with one
walk over a `memoryview`.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

# A KV entry's parts before the array elements: key length, key bytes, value type, item type, count.
_ARRAY_HEADER_PARTS = 5


def gguf_fields_to_dict(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata key of `reader` mapped to its Python value (the reader's own `GGUF.*` header entries left out)."""
    return {
        name: gguf_field_value(reader, field)
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def gguf_field_value(reader: GGUFReader, field: ReaderField) -> Any:
    """One field's value: str, int, float, bool, or a list of those."""
    main = field.types[0]
    if main == GGUFValueType.STRING:
        return _decode(field.parts[-1].tobytes())
    if main != GGUFValueType.ARRAY:
        return field.parts[-1].tolist()[0]
    if not field.data:
        return []
    item_type = field.types[1] if len(field.types) > 1 else None
    if item_type == GGUFValueType.STRING:
        return _string_array(reader, field)
    if item_type == GGUFValueType.ARRAY:
        # Nested arrays are rare and the reader flattens them; its slow path keeps whatever it can.
        return field.contents()
    return _numeric_array(reader, field)


def _start(field: ReaderField) -> int:
    """File offset of an array field's first element."""
    return field.offset + sum(int(part.nbytes) for part in field.parts[:_ARRAY_HEADER_PARTS])


def _numeric_array(reader: GGUFReader, field: ReaderField) -> list:
    dtype = field.parts[field.data[0]].dtype  # carries the file's byte order
    values = np.frombuffer(reader.data, dtype=dtype, count=len(field.data), offset=_start(field))
    return values.tolist()


def _string_array(reader: GGUFReader, field: ReaderField) -> list[str]:
    length_dtype = field.parts[field.data[0] - 1].dtype
    big = length_dtype.byteorder == ">" or (length_dtype.byteorder == "=" and sys.byteorder == "big")
    unpack = struct.Struct(">Q" if big else "<Q").unpack_from
    view = memoryview(reader.data)
    pos = _start(field)
    out = []
    for _ in range(len(field.data)):
        (n,) = unpack(view, pos)
        pos += 8
        out.append(_decode(view[pos : pos + n]))
        pos += n
    return out


def _decode(raw) -> str:
    # A few converted vocabularies hold byte sequences that are not valid UTF-8; keep them distinct.
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        return bytes(raw).decode("utf-8", errors="surrogateescape")
