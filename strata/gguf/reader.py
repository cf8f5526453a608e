"""Read a GGUF file without reading it: metadata is parsed, tensors stay memory-mapped.

Opening a 100 GB file touches only its header; tensor bytes are read when a tier asks
for them. Tensor shapes are given in torch order (outermost first), names are
llama.cpp's, and they are the engine's own parameter names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from strata.errors import BadModelFile

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order, outermost first
    offset: int  # absolute byte offset in the file
    n_bytes: int


class GGUFFile:
    """Metadata and tensor directory of one GGUF file; tensor bytes through `raw()`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        _check_header(self.path)
        try:
            reader = gguf.GGUFReader(self.path, "r")
        except (ValueError, IndexError, OSError, KeyError) as e:
            raise BadModelFile(f"{self.path}: truncated or corrupt GGUF header ({type(e).__name__})",
                               "re-download or re-convert the file") from None
        self.metadata = _fields_to_dict(reader)
        self.tensors: dict[str, TensorInfo] = {}
        size = self.path.stat().st_size
        for t in reader.tensors:
            info = TensorInfo(t.name, gguf.GGMLQuantizationType(int(t.tensor_type)),
                              tuple(int(d) for d in reversed(t.shape.tolist())),
                              int(t.data_offset), int(t.n_bytes))
            if info.offset + info.n_bytes > size:
                raise BadModelFile(
                    f"{self.path}: truncated GGUF: tensor {t.name} ends at byte "
                    f"{info.offset + info.n_bytes} but the file has {size} bytes",
                    "the download or copy was cut short; fetch the file again")
            self.tensors[t.name] = info
        del reader
        # Copy-on-write private mapping: pages are read on first touch and never written back.
        self._map = np.memmap(self.path, dtype=np.uint8, mode="c") if size else None

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise BadModelFile(f"{self.path}: GGUF has no general.architecture key",
                               "convert the model with llama.cpp's convert_hf_to_gguf.py")
        return arch

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view of the mapping (nothing is read yet)."""
        info = self.tensors[name]
        return self._map[info.offset: info.offset + info.n_bytes]

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        if key not in self.metadata:
            raise BadModelFile(f"{self.path}: GGUF metadata key {key!r} is missing",
                               "convert the model with a current llama.cpp converter")
        return self.metadata[key]


def _check_header(path: Path) -> None:
    if not path.exists():
        raise BadModelFile(f"{path}: no such file", "check the --model path")
    if path.is_dir():
        raise BadModelFile(f"{path}: is a directory without config.json",
                           "pass a .gguf file or a Hugging Face model directory")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise BadModelFile(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')",
                           "pass a .gguf file or a Hugging Face model directory")


def _fields_to_dict(reader: gguf.GGUFReader) -> dict:
    """Metadata as plain python values; the GGUF.* bookkeeping fields are left out."""
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = _field_value(field)
    return out


def _field_value(field):
    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return []
        # Numeric arrays: every element is its own part; concatenate them in one go.
        values = np.concatenate([field.parts[i] for i in field.data])
        return values.tolist()
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    value = field.parts[-1][0]
    if types[0] == gguf.GGUFValueType.BOOL:
        return bool(value)
    return value.item()
