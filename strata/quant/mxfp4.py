"""4-bit float (E2M1) microscaling formats: MXFP4 (gpt-oss) and NVFP4.

Both store E2M1 codes as indices into a table of doubled values (so the table is integral);
the block scale is decoded to *half* its value to compensate. MXFP4 has one E8M0 power-of-two
scale per 32 values; NVFP4 one unsigned E4M3 scale per 16 values, four of them per 64-value block.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from strata.quant.base import QuantType, register, table, unpack

E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e2m1(device: torch.device) -> torch.Tensor:
    return table("e2m1x2", lambda: torch.tensor(E2M1_DOUBLED, dtype=torch.float32), device)


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent byte -> float32 2^(e-128), built from bits (ggml_e8m0_to_fp32_half)."""
    x = e.to(torch.int32)
    bits = torch.where(x < 2, 0x00200000 << x, (x - 1) << 23)  # e<2 lands in the subnormals
    return bits.view(torch.float32)


def _ue4m3_half_table() -> torch.Tensor:
    """All 256 unsigned-E4M3 scale bytes -> half their value, as gguf-py decodes them.

    Bit 7 is ignored except that 0x00 and 0x7F both decode to 0; powers of two are built from
    bits so every entry is exact.
    """
    x = torch.arange(256, dtype=torch.int32)
    exp = (x >> 3) & 0xF
    man = (x & 0x7).to(torch.float32)
    pow2 = ((exp - 7 + 127) << 23).view(torch.float32)  # 2^(exp-7)
    raw = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * pow2)
    return torch.where((x == 0) | (x == 0x7F), torch.zeros(()), raw * 0.5)


@register
class MXFP4(QuantType):
    ggml_type = T.MXFP4

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = e8m0_to_fp32_half(blocks[:, :1])  # [n, 1]
        qs = blocks[:, 1:]  # [n, 16]
        # [n, 1, 16] -> [n, 2, 16] (low nibbles = values 0-15, high = 16-31) -> [n, 32]
        idx = unpack(qs.reshape(n, 1, 16), [0, 4], 1, 0x0F).reshape(n, 32)
        q = _e2m1(blocks.device)[idx.long()]  # [n, 32]
        return d * q


@register
class NVFP4(QuantType):
    ggml_type = T.NVFP4

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        lut = table("ue4m3_half", _ue4m3_half_table, blocks.device)
        d = lut[blocks[:, :4].long()].reshape(n, 4, 1)  # [n, 4, 1]: one scale per 16 values
        qs = blocks[:, 4:].reshape(n, 4, 8)  # [n, 32] -> [n, 4, 8]
        idx = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [n, 4, 16]
        q = _e2m1(blocks.device)[idx.long()]  # [n, 4, 16]
        return (d * q).reshape(n, 64)
