"""Registry of ggml tensor types and the small byte-twiddling helpers every family shares.

Each ggml type is one `QuantType` subclass that turns a batch of raw blocks into floats.
The math mirrors gguf-py's numpy reference (`gguf.quants`) operation for operation, so
results are bit-identical to it; keep that in mind before "simplifying" any expression.
All helpers assume a little-endian host, as GGUF files are little-endian.
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.errors import UnsupportedQuantType

QK_K = 256  # values per k-quant / i-quant super-block

_REGISTRY: dict[GGMLQuantizationType, "QuantType"] = {}


class QuantType:
    """One ggml tensor type: how many values a block holds, how many bytes it takes, and how to decode it.

    Subclasses set `ggml_type`; `block_size` and `type_size` are filled in from
    `gguf.GGML_QUANT_SIZES` so they can never disagree with the file format.
    """

    ggml_type: ClassVar[GGMLQuantizationType]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "ggml_type" in cls.__dict__:
            cls.block_size, cls.type_size = GGML_QUANT_SIZES[cls.ggml_type]

    @property
    def name(self) -> str:
        return self.ggml_type.name

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 `[n_blocks, type_size]` -> float32 `[n_blocks, block_size]`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<QuantType {self.name}: {self.block_size} values in {self.type_size} bytes>"


Q = TypeVar("Q", bound=type[QuantType])


def register(cls: Q) -> Q:
    """Class decorator: make `cls` the decoder for its ggml type."""
    if cls.ggml_type in _REGISTRY:
        raise ValueError(f"ggml type {cls.ggml_type.name} registered twice")
    _REGISTRY[cls.ggml_type] = cls()
    return cls


def supported() -> tuple[GGMLQuantizationType, ...]:
    return tuple(sorted(_REGISTRY, key=int))


def _type_name(qtype) -> str:
    if isinstance(qtype, GGMLQuantizationType):
        return qtype.name
    try:
        return GGMLQuantizationType(int(qtype)).name
    except (ValueError, TypeError):
        return f"ggml type {qtype!r}"


def get(qtype: GGMLQuantizationType | int | str) -> QuantType:
    """The decoder for `qtype` (enum, its integer id as stored in a file, or its name)."""
    key = None
    try:
        if isinstance(qtype, str):
            key = GGMLQuantizationType[qtype.upper()]
        else:
            key = GGMLQuantizationType(int(qtype))
    except (KeyError, ValueError, TypeError):
        pass
    if key is not None and key in _REGISTRY:
        return _REGISTRY[key]
    raise UnsupportedQuantType(
        f"tensor type {_type_name(qtype)} is not supported",
        "supported: " + ", ".join(t.name for t in supported()),
    )


# ---------------------------------------------------------------- byte helpers
# Blocks are uint8 [n, type_size]; these read little-endian fields out of byte columns.


def reinterpret(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 [..., k*size] as dtype [..., k], copying only if the bytes are misaligned."""
    size = torch.empty((), dtype=dtype).element_size()
    if not b.is_contiguous() or b.storage_offset() % size:
        b = b.clone(memory_format=torch.contiguous_format)
    return b.view(dtype)


def f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2k] -> float32 [n, k] (IEEE half, exact widening)."""
    return reinterpret(b, torch.float16).float()


def u16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2k] -> int32 [n, k] holding the unsigned 16-bit values."""
    return reinterpret(b, torch.int16).to(torch.int32) & 0xFFFF


def u32(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4k] -> int64 [n, k] holding the unsigned 32-bit values (no sign surprises on >>)."""
    return reinterpret(b, torch.int32).to(torch.int64) & 0xFFFFFFFF


def shifts(values, device: torch.device, ndim: int, dim: int) -> torch.Tensor:
    """A 1-D shift vector shaped to broadcast along `dim` of an `ndim`-dim tensor."""
    shape = [1] * ndim
    shape[dim] = len(values)
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def unpack(b: torch.Tensor, shift_list, dim: int, mask: int) -> torch.Tensor:
    """`(b.unsqueeze(dim) >> shift_list) & mask` -- gguf-py's bit-plane unpacking idiom."""
    b = b.unsqueeze(dim)
    return (b >> shifts(shift_list, b.device, b.dim(), dim)) & mask


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def table(key: str, build, device: torch.device) -> torch.Tensor:
    """Build a lookup table once (on CPU, lazily) and keep one copy per device."""
    cpu = _TABLES.get((key, torch.device("cpu")))
    if cpu is None:
        cpu = _TABLES[(key, torch.device("cpu"))] = build()
    hit = _TABLES.get((key, device))
    if hit is None:
        hit = _TABLES[(key, device)] = cpu.to(device)
    return hit
