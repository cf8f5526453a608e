"""The loader model files build from.

Weights come from a `WeightSource` as `QTensor`s (strata/formats/weights.py). Dense weights
are `Linear`/`Embedding` layers (strata/models/linear.py) that keep a quantized weight in its
blocks when a CPU kernel multiplies it, and hold float tensors otherwise. `WeightLoader`
checks names and shapes so a wrong file fails loudly at load time, naming the tensor.
"""

from __future__ import annotations

import torch

from strata.errors import BadModelFile
from strata.formats.weights import FLOAT_TYPES, QTensor, WeightSource
from strata.models.linear import Embedding, Linear, keeps_quantized


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
        """The stored tensor when it stays quantized (see `linear.keeps_quantized`); a float16 or
        bfloat16 matrix in its stored type (a view of the file, no copy); other types as floats."""
        t = self.quantized(name, shape)
        if keeps_quantized(t):
            return t
        stored = FLOAT_TYPES.get(t.qtype)
        if stored is not None and stored != torch.float32 and len(shape) == 2:
            return t.dequantize(stored)
        return t.dequantize(self.dtype)

    def linear(self, name: str, shape: tuple[int, ...], bias: str | None = None):
        """A `Linear` for weight `name` (out, in), with the optional bias tensor `bias` when present."""
        b = self.optional(bias, (shape[0],)) if bias is not None else None
        return Linear(self._kept(name, shape), b, name)

    def embedding(self, name: str, shape: tuple[int, ...]):
        return Embedding(self._kept(name, shape), self.dtype)

    def finish(self, ignore: tuple[str, ...] = ()) -> None:
        extra = sorted(n for n in self._available - self._used
                       if not any(n.startswith(p) for p in ignore))
        if extra:
            shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
            raise BadModelFile(f"{self.source.description}: {len(extra)} unexpected tensors ({shown})",
                               "the file does not match its declared architecture")
