"""Read a GGUF file without reading it: metadata is parsed, tensors stay memory-mapped.

Opening a 100 GB file touches only its header; tensor bytes are read when a tier asks
for them. Tensor shapes are given in torch order (outermost first), names are
llama.cpp's, and they are the engine's own parameter names.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from strata.errors import BadModelFile, UnsupportedQuantType
from strata.gguf.header import HeaderError, parse_header
from strata.madvise import MADV_POPULATE_READ, madvise as _madvise

GGUF_MAGIC = b"GGUF"
POPULATE_CHUNK = 64 * 2**20  # bytes per madvise call (each holds the process's memory-map lock)


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
        size = self.path.stat().st_size
        self._map = _map_read_only(self.path, size)
        try:
            self.metadata, entries, data_start = parse_header(self._map)
        except HeaderError as e:
            raise BadModelFile(f"{self.path}: truncated or corrupt GGUF header ({e})",
                               "the download or copy was cut short; fetch the file again") from None
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in entries:
            info = _tensor_info(self.path, name, dims, type_id, data_start + offset)
            if info.offset + info.n_bytes > size:
                raise BadModelFile(
                    f"{self.path}: truncated GGUF: tensor {name} ends at byte "
                    f"{info.offset + info.n_bytes} but the file has {size} bytes",
                    "the download or copy was cut short; fetch the file again")
            self.tensors[name] = info

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

    def close(self) -> None:
        """Drop this file's reference to its mapping: it is unmapped once no tensor views it (a view
        keeps its bytes mapped; numpy refuses to close a mapping that views still export)."""
        self._map = None

    def populate(self) -> bool:
        """Map every page of the file into this process now, as llama.cpp's mmap(MAP_POPULATE)
        does, reading from disk what the page cache lacks. Otherwise a decode token's first reads
        of experts not used before fault pages in one at a time: a 4-layer qwen3-30b Q4_K_M took
        ~245 minor faults a token on a prompt's first run (1.49 GiB populated in 0.35-0.54 s).
        Only for a file that fits in RAM (the caller's check). False where the kernel cannot."""
        madvise = _madvise()
        if madvise is None:
            return False
        base, size = self._map.ctypes.data, self._map.size
        for start in range(0, size, POPULATE_CHUNK):
            if madvise(base + start, min(POPULATE_CHUNK, size - start), MADV_POPULATE_READ) != 0:
                return False  # an older kernel: pages fault in on first use, as before
        return True

    def require(self, key: str):
        if key not in self.metadata:
            raise BadModelFile(f"{self.path}: GGUF metadata key {key!r} is missing",
                               "convert the model with a current llama.cpp converter")
        return self.metadata[key]


def _map_read_only(path: Path, size: int) -> np.ndarray:
    """A shared read-only mapping: pages are read on first touch and count as page cache, not
    as the process's memory. A private writable ("c") mapping of a file larger than RAM is
    refused under the kernel's default overcommit rules, so it is never used."""
    try:
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
    except (OSError, ValueError) as e:
        raise BadModelFile(f"{path}: cannot memory-map the file ({e})",
                           "check the file is readable and on a local filesystem") from None


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


def _tensor_info(path: Path, name: str, dims, type_id: int, offset: int) -> TensorInfo:
    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedQuantType(f"{path}: tensor {name} has unknown ggml type id {type_id}",
                                   "this file needs a newer Strata") from None
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise BadModelFile(f"{path}: tensor {name} has rows of {dims[0]} values, not a multiple of "
                           f"{qtype.name}'s block of {block}", "the file is corrupt; fetch it again")
    n_values = math.prod(dims)  # Python ints: no overflow (the header checked the int64 range)
    return TensorInfo(name, qtype, tuple(int(d) for d in reversed(dims)), offset,
                      n_values // block * type_size)
