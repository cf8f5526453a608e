"""The original 32-value ggml block formats (Q4_0 .. Q8_0): one f16 scale, maybe an f16 min.

Nibble layout (Q4/Q5): byte j holds value j in its low nibble and value j+16 in its high nibble.
Q5 adds a 32-bit word whose bit i is the fifth bit of value i.
Q8_1 is not here: gguf-py has no reference decoder to be bit-exact against.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from strata.quant.base import QuantType, f16, register, u32, unpack


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 16] -> uint8 [n, 32]: all low nibbles, then all high nibbles."""
    n = qs.shape[0]
    # [n, 1, 2, 16] -> [n, 32]
    return unpack(qs.reshape(n, 1, 16), [0, 4], 2, 0x0F).reshape(n, 32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian u32) -> uint8 [n, 32] holding bit i of that word."""
    word = u32(qh)  # [n, 1]
    bits = word >> torch.arange(32, device=qh.device, dtype=torch.int64).reshape(1, 32)
    return (bits & 1).to(torch.uint8)  # [n, 32]


@register
class Q4_0(QuantType):
    ggml_type = T.Q4_0

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d = f16(blocks[:, :2])  # [n, 1]
        q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8  # [n, 32]
        return d * q.to(torch.float32)


@register
class Q4_1(QuantType):
    ggml_type = T.Q4_1

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d = f16(blocks[:, 0:2])  # [n, 1]
        m = f16(blocks[:, 2:4])  # [n, 1]
        q = _nibbles(blocks[:, 4:]).to(torch.float32)  # [n, 32]
        return (d * q) + m


@register
class Q5_0(QuantType):
    ggml_type = T.Q5_0

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d = f16(blocks[:, 0:2])  # [n, 1]
        qh = _fifth_bits(blocks[:, 2:6])  # [n, 32]
        ql = _nibbles(blocks[:, 6:])  # [n, 32]
        q = (ql | (qh << 4)).to(torch.int8) - 16
        return d * q.to(torch.float32)


@register
class Q5_1(QuantType):
    ggml_type = T.Q5_1

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d = f16(blocks[:, 0:2])  # [n, 1]
        m = f16(blocks[:, 2:4])  # [n, 1]
        qh = _fifth_bits(blocks[:, 4:8])  # [n, 32]
        ql = _nibbles(blocks[:, 8:])  # [n, 32]
        q = (ql | (qh << 4)).to(torch.float32)
        return (d * q) + m


@register
class Q8_0(QuantType):
    ggml_type = T.Q8_0

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d = f16(blocks[:, :2])  # [n, 1]
        x = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)  # [n, 32]
        return x * d

