"""k-quants: 256-value super-blocks split into 16- or 32-value sub-blocks with 4-8 bit sub-scales.

Field order per block and the packing of the sub-scales follow ggml's `block_qN_K` structs.
Q8_K is not here: it is an intermediate format for dot products and gguf-py has no decoder for it.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from strata.quant.base import QK_K, QuantType, f16, register, unpack


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 bytes into eight 6-bit scales and eight 6-bit mins (uint8 [n, 8] each).

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 hold the low nibbles of scales 4-7 (low half) and mins 4-7 (high half).
    """
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)  # [n, 12] -> [n, 3, 4]
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # [n, 8]
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)  # [n, 8]
    return sc, mn


@register
class Q2_K(QuantType):
    ggml_type = T.Q2_K

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        scales = blocks[:, : QK_K // 16]  # [n, 16]: low nibble scale, high nibble min
        qs = blocks[:, QK_K // 16 : QK_K // 16 + QK_K // 4]  # [n, 64]
        d = f16(blocks[:, 80:82])  # [n, 1]
        dmin = f16(blocks[:, 82:84])  # [n, 1]

        dl = (d * (scales & 0xF).to(torch.float32)).reshape(n, QK_K // 16, 1)  # [n, 16, 1]
        ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, QK_K // 16, 1)  # [n, 16, 1]

        # [n, 2, 32] -> [n, 2, 4, 32] (2-bit planes) -> [n, 16, 16]
        q = unpack(qs.reshape(n, 2, 32), [0, 2, 4, 6], 2, 3)
        q = q.reshape(n, QK_K // 16, 16).to(torch.float32)

        return (dl * q - ml).reshape(n, QK_K)


@register
class Q3_K(QuantType):
    ggml_type = T.Q3_K

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        hmask = blocks[:, : QK_K // 8]  # [n, 32]
        qs = blocks[:, 32:96]  # [n, 64]
        scales = blocks[:, 96:108]  # [n, 12]
        d = f16(blocks[:, 108:110])  # [n, 1]

        # sixteen 6-bit scales: low nibbles from bytes 0-7, top 2 bits from bytes 8-11
        lscales = unpack(scales[:, :8].reshape(n, 8), [0, 4], 1, 0x0F).reshape(n, 16)  # [n, 2, 8] -> [n, 16]
        hscales = unpack(scales[:, 8:].reshape(n, 4), [0, 2, 4, 6], 1, 0x03).reshape(n, 16)  # [n, 4, 4] -> [n, 16]
        sc = ((lscales | (hscales << 4)).to(torch.int8) - 32).to(torch.float32)

        dl = (d * sc).reshape(n, 16, 1)  # [n, 16, 1]

        # [n, 2, 32] -> [n, 2, 4, 32] -> [n, 16, 16]
        ql = unpack(qs.reshape(n, 2, 32), [0, 2, 4, 6], 2, 3).reshape(n, 16, QK_K // 16)
        # [n, 1, 32] -> [n, 1, 8, 32] -> [n, 16, 16]
        qh = unpack(hmask.reshape(n, 1, 32), list(range(8)), 2, 1).reshape(n, 16, QK_K // 16)
        qh = qh ^ 1  # a set mask bit means "no -4 offset"
        q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)

        return (dl * q).reshape(n, QK_K)


@register
class Q4_K(QuantType):
    ggml_type = T.Q4_K

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])  # [n, 1]
        dmin = f16(blocks[:, 2:4])  # [n, 1]
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        qs = blocks[:, 16:]  # [n, 128]

        d = (d * sc.to(torch.float32)).reshape(n, 8, 1)  # [n, 8, 1]
        dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)  # [n, 8, 1]

        # [n, 4, 32] -> [n, 4, 2, 32] (low, high nibbles) -> [n, 8, 32]
        q = unpack(qs.reshape(n, 4, 32), [0, 4], 2, 0x0F).reshape(n, 8, 32).to(torch.float32)

        return (d * q - dm).reshape(n, QK_K)


@register
class Q5_K(QuantType):
    ggml_type = T.Q5_K

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])  # [n, 1]
        dmin = f16(blocks[:, 2:4])  # [n, 1]
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        qh = blocks[:, 16:48]  # [n, 32]
        qs = blocks[:, 48:]  # [n, 128]

        d = (d * sc.to(torch.float32)).reshape(n, 8, 1)  # [n, 8, 1]
        dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)  # [n, 8, 1]

        ql = unpack(qs.reshape(n, 4, 32), [0, 4], 2, 0x0F).reshape(n, 8, 32)  # [n, 4, 2, 32] -> [n, 8, 32]
        qh = unpack(qh.reshape(n, 1, 32), list(range(8)), 2, 1).reshape(n, 8, 32)  # [n, 1, 8, 32] -> [n, 8, 32]
        q = (ql | (qh << 4)).to(torch.float32)

        return (d * q - dm).reshape(n, QK_K)


@register
class Q6_K(QuantType):
    ggml_type = T.Q6_K

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        ql = blocks[:, :128]  # [n, 128]
        qh = blocks[:, 128:192]  # [n, 64]
        scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)  # [n, 16]
        d = f16(blocks[:, 208:210])  # [n, 1]

        d = (d * scales).reshape(n, QK_K // 16, 1)  # [n, 16, 1]

        ql = unpack(ql.reshape(n, 2, 64), [0, 4], 2, 0x0F).reshape(n, 8, 32)  # [n, 2, 2, 64] -> [n, 8, 32]
        qh = unpack(qh.reshape(n, 2, 32), [0, 2, 4, 6], 2, 0x03).reshape(n, 8, 32)  # [n, 2, 4, 32] -> [n, 8, 32]
        q = (ql | (qh << 4)).to(torch.int8) - 32
        q = q.reshape(n, QK_K // 16, 16).to(torch.float32)  # [n, 16, 16]

        return (d * q).reshape(n, QK_K)
