"""Weights as the file stores them: `QTensor` keeps a tensor in its stored ggml type (quantized
bytes, never copied), so expert tiers can move and multiply experts exactly as the file holds
them; `WeightSource` is what a file format (GGUF, safetensors) offers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import gguf
import torch

from strata import quant

FLOAT_TYPES = {gguf.GGMLQuantizationType.F32: torch.float32,
               gguf.GGMLQuantizationType.F16: torch.float16,
               gguf.GGMLQuantizationType.BF16: torch.bfloat16}


@dataclass(slots=True)
class QTensor:
    """A tensor in its stored type: `raw` holds its bytes, `shape` its logical torch shape."""

    raw: torch.Tensor  # uint8, (*shape[:-1], row_bytes)
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]

    @classmethod
    def from_float(cls, t: torch.Tensor) -> "QTensor":
        for qtype, dtype in FLOAT_TYPES.items():
            if t.dtype == dtype:
                raw = t.contiguous().view(torch.uint8).reshape(*t.shape[:-1], -1)
                return cls(raw, qtype, tuple(t.shape))
        return cls.from_float(t.float())

    def __getitem__(self, index: int) -> "QTensor":
        """One slice of the outermost dimension: one expert of a stacked `[E, out, in]`."""
        return QTensor(self.raw[index], self.qtype, self.shape[1:])

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def to(self, device) -> "QTensor":
        """The same blocks on another device (self when already there)."""
        return QTensor(self.raw.to(device), self.qtype, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        dense = FLOAT_TYPES.get(self.qtype)
        if dense is not None:  # a view, not a copy, when the type already matches
            return self.raw.contiguous().view(dense).reshape(self.shape).to(dtype)
        return quant.dequantize(self.raw, self.qtype, self.shape).to(dtype)


class WeightSource(Protocol):
    """What a file format offers: names, stored types and shapes, and raw tensors."""

    description: str

    def names(self) -> list[str]: ...

    def get(self, name: str) -> QTensor: ...
