"""Plain (unquantized) element types: the bytes are the values, so decoding is a reinterpretation.

F32/F16/BF16 match gguf-py bit for bit; F64 and the integer types are not handled by
gguf-py's `dequantize`, and follow numpy's `astype(np.float32)` (round to nearest).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from strata.quant.base import QuantType, register, reinterpret


class _Reinterpret(QuantType):
    """A one-value block: view the bytes as `dtype`, widen/narrow to float32."""

    dtype: torch.dtype

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        # [n, type_size] bytes -> [n, 1] values
        return reinterpret(blocks, self.dtype).to(torch.float32)


@register
class F32(_Reinterpret):
    ggml_type = T.F32
    dtype = torch.float32


@register
class F16(_Reinterpret):
    ggml_type = T.F16
    dtype = torch.float16


@register
class BF16(QuantType):
    """bfloat16 is the top half of a float32, so shifting the bits up 16 is the exact conversion."""

    ggml_type = T.BF16

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        # [n, 2] bytes -> [n, 1] int16 -> int32 bits -> float32
        bits = reinterpret(blocks, torch.int16).to(torch.int32) << 16
        return bits.view(torch.float32)


@register
class F64(_Reinterpret):
    ggml_type = T.F64
    dtype = torch.float64


@register
class I8(_Reinterpret):
    ggml_type = T.I8
    dtype = torch.int8


@register
class I16(_Reinterpret):
    ggml_type = T.I16
    dtype = torch.int16


@register
class I32(_Reinterpret):
    ggml_type = T.I32
    dtype = torch.int32


@register
class I64(_Reinterpret):
    ggml_type = T.I64
    dtype = torch.int64
