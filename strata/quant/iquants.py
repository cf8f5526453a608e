"""i-quants: values come from lattice codebooks ("grids") indexed per 4 or 8 values, plus sign bits.

The codebooks and the 7-bit -> 8-sign table are taken from gguf-py at first use, so they are
the very tables the reference decoder uses; each is turned into a torch tensor once per device.
IQ4_NL/IQ4_XS use a fixed non-linear 16-entry table instead of a grid.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from strata.quant.base import QK_K, QuantType, f16, register, table, u16, u32, unpack

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _grid(name: str, device: torch.device) -> torch.Tensor:
    """gguf-py's decoded codebook for `name` as float32 [n_entries, values_per_entry]."""

    def build() -> torch.Tensor:
        import gguf.quants

        ref = getattr(gguf.quants, name)
        ref.init_grid()
        return torch.from_numpy(np.array(ref.grid, dtype=np.float32).reshape(ref.grid_shape))

    return table(f"grid:{name}", build, device)


def _ksigns(device: torch.device) -> torch.Tensor:
    """float32 [128, 8]: row i is the eight +-1 factors encoded by 7-bit sign index i.

    The eighth sign is implied by parity; gguf-py's byte table already spells it out.
    """

    def build() -> torch.Tensor:
        import gguf.quants

        k = torch.from_numpy(np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).copy())  # [128]
        bits = unpack(k, list(range(8)), 1, 1)  # [128, 8]
        return torch.where(bits == 0, 1.0, -1.0).to(torch.float32)

    return table("ksigns", build, device)


def _sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] of explicit sign bits -> float32 [..., k, 8] of +-1."""
    bits = unpack(signs, list(range(8)), signs.dim(), 1)
    return torch.where(bits == 0, 1.0, -1.0).to(torch.float32)


def _iq4_values(device: torch.device) -> torch.Tensor:
    return table("iq4nl", lambda: torch.tensor(IQ4_NL_VALUES, dtype=torch.float32), device)


def _nibble_scales(b: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] -> float32 [n, 2k]: low nibble then high nibble of each byte."""
    n, k = b.shape
    return unpack(b, [0, 4], 2, 0x0F).reshape(n, 2 * k).to(torch.float32)  # [n, k, 2] -> [n, 2k]


@register
class IQ2_XXS(QuantType):
    ggml_type = T.IQ2_XXS

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2]).reshape(n, 1, 1)  # [n, 1, 1]
        qs = blocks[:, 2:].reshape(n, 8, 8)  # [n, 64] -> [n, 8 sub-blocks, 4 grid bytes + 1 u32]
        aux = u32(qs[:, :, 4:])  # [n, 8, 1]: 4-bit scale on top, four 7-bit sign indices below

        db = d * (0.5 + (aux >> 28).to(torch.float32)) * 0.25
        db = db.reshape(n, 8, 1, 1)  # [n, 8, 1, 1]

        sidx = (aux >> torch.tensor([0, 7, 14, 21], device=blocks.device)) & 0x7F  # [n, 8, 4]
        signs = _ksigns(blocks.device)[sidx]  # [n, 8, 4, 8]
        grid = _grid("IQ2_XXS", blocks.device)[qs[:, :, :4].long()]  # [n, 8, 4, 8]

        return (db * grid * signs).reshape(n, QK_K)


@register
class IQ2_XS(QuantType):
    ggml_type = T.IQ2_XS

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2])  # [n, 1]
        qs = u16(blocks[:, 2:66])  # [n, 32]: 9-bit grid index | 7-bit sign index << 9
        scales = _nibble_scales(blocks[:, 66:74])  # [n, 16]

        db = (d * (0.5 + scales) * 0.25).reshape(n, 16, 1, 1)  # [n, 16, 1, 1]

        signs = _ksigns(blocks.device)[(qs >> 9).long()].reshape(n, 16, 2, 8)  # [n, 32, 8] -> [n, 16, 2, 8]
        grid = _grid("IQ2_XS", blocks.device)[(qs & 511).long()].reshape(n, 16, 2, 8)

        return (db * grid * signs).reshape(n, QK_K)


@register
class IQ2_S(QuantType):
    ggml_type = T.IQ2_S

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2])  # [n, 1]
        qs = blocks[:, 2:34]  # [n, 32]: low 8 bits of the grid indices
        sign_bytes = blocks[:, 34:66]  # [n, 32]: explicit sign bits
        qh = blocks[:, 66:74]  # [n, 8]: high 2 bits of the grid indices
        scales = _nibble_scales(blocks[:, 74:82])  # [n, 16]

        db = (d * (0.5 + scales) * 0.25).reshape(n, 16, 1, 1)  # [n, 16, 1, 1]

        signs = _sign_bits(sign_bytes).reshape(n, 16, 2, 8)  # [n, 32, 8] -> [n, 16, 2, 8]

        hi = unpack(qh, [0, 2, 4, 6], 2, 0x03).reshape(n, 32).long()  # [n, 8, 4] -> [n, 32]
        idx = qs.long() | (hi << 8)
        grid = _grid("IQ2_S", blocks.device)[idx].reshape(n, 16, 2, 8)  # [n, 32, 8] -> [n, 16, 2, 8]

        return (db * grid * signs).reshape(n, QK_K)


@register
class IQ3_XXS(QuantType):
    ggml_type = T.IQ3_XXS

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2]).reshape(n, 1)  # [n, 1]
        qs = blocks[:, 2:66]  # [n, 64]: one grid index per 4 values
        aux = u32(blocks[:, 66:98])  # [n, 8]: 4-bit scale on top, four 7-bit sign indices below

        db = (d * (0.5 + (aux >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)  # [n, 8, 1, 1]

        sidx = unpack(aux, [0, 7, 14, 21], 2, 0x7F)  # [n, 8, 4]
        signs = _ksigns(blocks.device)[sidx.long()]  # [n, 8, 4, 8]
        grid = _grid("IQ3_XXS", blocks.device)[qs.long()].reshape(n, 8, 4, 8)  # [n, 64, 4] -> [n, 8, 4, 8]

        return (db * grid * signs).reshape(n, QK_K)


@register
class IQ3_S(QuantType):
    ggml_type = T.IQ3_S

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2])  # [n, 1]
        qs = blocks[:, 2:66]  # [n, 64]: low 8 bits of the grid indices
        qh = blocks[:, 66:74]  # [n, 8]: bit 8 of the grid indices
        sign_bytes = blocks[:, 74:106]  # [n, 32]
        scales = unpack(blocks[:, 106:110], [0, 4], 2, 0x0F).reshape(n, 8)  # [n, 4, 2] -> [n, 8]

        db = (d * (1 + 2 * scales).to(torch.float32)).reshape(n, 8, 1, 1)  # [n, 8, 1, 1]

        signs = _sign_bits(sign_bytes).reshape(n, 8, 4, 8)  # [n, 32, 8] -> [n, 8, 4, 8]

        hi = unpack(qh, list(range(8)), 2, 1).reshape(n, 64).long()  # [n, 8, 8] -> [n, 64]
        idx = qs.long() | (hi << 8)
        grid = _grid("IQ3_S", blocks.device)[idx].reshape(n, 8, 4, 8)  # [n, 64, 4] -> [n, 8, 4, 8]

        return (db * grid * signs).reshape(n, QK_K)


@register
class IQ1_S(QuantType):
    ggml_type = T.IQ1_S
    delta = 0.125

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2])  # [n, 1]
        qs = blocks[:, 2:34]  # [n, 32]: low 8 bits of the grid indices
        qh = u16(blocks[:, 34:50])  # [n, 8]: 3-bit scale, delta sign, four 3-bit index highs

        dl = (d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)  # [n, 8, 1, 1]
        delta = torch.where((qh & 0x8000) == 0, self.delta, -self.delta).to(torch.float32)
        delta = delta.reshape(n, 8, 1, 1)  # [n, 8, 1, 1]

        hi = unpack(qh, [0, 3, 6, 9], 2, 7).reshape(n, 32).long()  # [n, 8, 4] -> [n, 32]
        idx = qs.long() | (hi << 8)
        grid = _grid("IQ1_S", blocks.device)[idx].reshape(n, 8, 4, 8)  # [n, 32, 8] -> [n, 8, 4, 8]

        return (dl * (grid + delta)).reshape(n, QK_K)


@register
class IQ1_M(QuantType):
    """Like IQ1_S, but the f16 super-scale is scattered over the top nibbles of the four scale words."""

    ggml_type = T.IQ1_M
    delta = 0.125

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        qs = blocks[:, :32]  # [n, 32]: low 8 bits of the grid indices
        qh = blocks[:, 32:48]  # [n, 16]: per nibble, 3 index bits + delta sign
        sc = u16(blocks[:, 48:56])  # [n, 4]

        parts = (sc & 0xF000) >> torch.tensor([12, 8, 4, 0], dtype=torch.int32, device=blocks.device)
        bits = parts[:, 0] | parts[:, 1] | parts[:, 2] | parts[:, 3]  # [n]
        bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
        d = bits.view(torch.float16).to(torch.float32).reshape(n, 1)  # [n, 1]

        scales = unpack(sc, [0, 3, 6, 9], 2, 0x07).reshape(n, 16)  # [n, 4, 4] -> [n, 16]
        dl = (d * (2 * scales + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)  # [n, 8, 2, 1, 1]

        qh = unpack(qh, [0, 4], 2, 0x0F)  # [n, 16, 2]
        idx = qs.long() | ((qh & 0x07).reshape(n, 32).long() << 8)  # [n, 32]

        delta = torch.where((qh & 0x08) == 0, self.delta, -self.delta).to(torch.float32)
        delta = delta.reshape(n, 8, 2, 2, 1)  # [n, 8, 2, 2, 1]

        grid = _grid("IQ1_M", blocks.device)[idx].reshape(n, 8, 2, 2, 8)  # [n, 32, 8] -> [n, 8, 2, 2, 8]

        return (dl * (grid + delta)).reshape(n, QK_K)


@register
class IQ4_NL(QuantType):
    ggml_type = T.IQ4_NL

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2])  # [n, 1]
        # [n, 1, 16] -> [n, 2, 16] (low nibbles = values 0-15) -> [n, 32]
        idx = unpack(blocks[:, 2:].reshape(n, 1, 16), [0, 4], 1, 0x0F).reshape(n, 32)
        return d * _iq4_values(blocks.device)[idx.long()]


@register
class IQ4_XS(QuantType):
    ggml_type = T.IQ4_XS

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d = f16(blocks[:, :2])  # [n, 1]
        scales_h = u16(blocks[:, 2:4])  # [n, 1]: 2 high bits per sub-block
        scales_l = blocks[:, 4:8]  # [n, 4]: 4 low bits per sub-block
        qs = blocks[:, 8:]  # [n, 128]

        lo = unpack(scales_l, [0, 4], 2, 0x0F).reshape(n, 8)  # [n, 4, 2] -> [n, 8]
        hi = unpack(scales_h, [0, 2, 4, 6, 8, 10, 12, 14], 2, 0x03).reshape(n, 8)  # [n, 1, 8] -> [n, 8]
        scales = (lo | (hi << 4)).to(torch.int8) - 32
        dl = (d * scales.to(torch.float32)).reshape(n, 8, 1)  # [n, 8, 1]

        # [n, 8, 16] -> [n, 8, 2, 16] (low then high nibbles) -> [n, 8, 32]
        idx = unpack(qs.reshape(n, 8, 16), [0, 4], 2, 0x0F).reshape(n, 8, 32)
        q = _iq4_values(blocks.device)[idx.long()]  # [n, 8, 32]

        return (dl * q).reshape(n, QK_K)
