"""Weights as the file stores them, and the loader model files build from.

A `QTensor` keeps a tensor in its stored ggml type (quantized bytes, never copied), so
expert tiers can move and multiply experts exactly as the file holds them. Dense weights
are `Linear`/`Embedding` layers (strata/models/linear.py) that keep a quantized weight in its
blocks when a CPU kernel multiplies it, and hold float tensors otherwise. `WeightLoader`
checks names and shapes so a wrong file fails loudly at load time, naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import gguf
import torch

from strata import quant
from strata.errors import BadModelFile

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


class WeightLoader:
    """Hands out tensors by GGUF name, checking shapes; `finish()` refuses leftovers."""

    def __init__(self, source: WeightSource, dtype: torch.dtype = torch.float32, on_tensor=None):
        self.source = source
        self.dtype = dtype
        self._available = set(source.names())
        self._used: set[str] = set()
        self._on_tensor = on_tensor  # progress: called once per tensor handed out

    def has(self, name: str) -> bool:
        return name in self._available

    def quantized(self, name: str, shape: tuple[int, ...]) -> QTensor:
        if name not in self._available:
            raise BadModelFile(f"{self.source.description}: tensor {name!r} is missing",
                               "the file is incomplete or was converted for another architecture")
        t = self.source.get(name)
        if tuple(t.shape) != tuple(shape):
            raise BadModelFile(
                f"{self.source.description}: tensor {name!r} has shape {tuple(t.shape)}, "
                f"expected {tuple(shape)} from the model's hyper-parameters",
                "the metadata and the weights disagree; re-convert the model")
        self._used.add(name)
        if self._on_tensor is not None:
            self._on_tensor()
        return t

    def dense(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.quantized(name, shape).dequantize(self.dtype)

    def optional(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        return self.dense(name, shape) if name in self._available else None

    def _kept(self, name: str, shape: tuple[int, ...]):
        """The stored tensor when it stays quantized (see `linear.keeps_quantized`), else floats."""
        from strata.models.linear import keeps_quantized

        t = self.quantized(name, shape)
        return t if keeps_quantized(t) else t.dequantize(self.dtype)

    def linear(self, name: str, shape: tuple[int, ...], bias: str | None = None):
        """A `Linear` for weight `name` (out, in), with the optional bias tensor `bias` when present."""
        from strata.models.linear import Linear

        b = self.optional(bias, (shape[0],)) if bias is not None else None
        return Linear(self._kept(name, shape), b)

    def optional_linear(self, name: str, shape: tuple[int, ...]):
        return self.linear(name, shape) if name in self._available else None

    def embedding(self, name: str, shape: tuple[int, ...]):
        from strata.models.linear import Embedding

        return Embedding(self._kept(name, shape), self.dtype)

    def finish(self, ignore: tuple[str, ...] = ()) -> None:
        extra = sorted(n for n in self._available - self._used
                       if not any(n.startswith(p) for p in ignore))
        if extra:
            shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
            raise BadModelFile(f"{self.source.description}: {len(extra)} unexpected tensors ({shown})",
                               "the file does not match its declared architecture")
