"""Ternary formats ({-1, 0, +1} times one f16 scale per 256 values), used by BitNet-style models.

TQ1_0 packs five trits per byte as a fixed-point fraction of 3^5 (1.6 bits per value);
TQ2_0 simply spends two bits per trit.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from strata.quant.base import QK_K, QuantType, f16, register, unpack


def _times(b: torch.Tensor, factors: list[int]) -> torch.Tensor:
    """uint8 [n, k] -> uint8 [n, len(factors) * k]: each byte times each factor, mod 256 (as uint8 math)."""
    n, k = b.shape
    f = torch.tensor(factors, dtype=torch.uint8, device=b.device).reshape(1, len(factors), 1)
    return (b.reshape(n, 1, k) * f).reshape(n, len(factors) * k)  # [n, F, k] -> [n, F*k]


@register
class TQ1_0(QuantType):
    ggml_type = T.TQ1_0

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n_qs = (QK_K - 4 * QK_K // 64) // 5  # 48 bytes of 5 trits each
        qs = blocks[:, :n_qs]  # [n, 48]
        qh = blocks[:, n_qs : n_qs + QK_K // 64]  # [n, 4]: 4 trits each
        d = f16(blocks[:, n_qs + QK_K // 64 :])  # [n, 1]

        # multiplying by 3^i shifts trit i to the top of the byte, where *3 >> 8 reads it off
        q = torch.cat(
            [
                _times(qs[:, :32], [1, 3, 9, 27, 81]),  # [n, 160]
                _times(qs[:, 32:], [1, 3, 9, 27, 81]),  # [n, 80]
                _times(qh, [1, 3, 9, 27]),  # [n, 16]
            ],
            dim=-1,
        )  # [n, 256]
        q = ((q.to(torch.int32) * 3) >> 8).to(torch.int8) - 1
        return d * q.to(torch.float32)


@register
class TQ2_0(QuantType):
    ggml_type = T.TQ2_0

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        qs = blocks[:, : QK_K // 4]  # [n, 64]
        d = f16(blocks[:, QK_K // 4 :])  # [n, 1]

        # [n, 2, 32] -> [n, 2, 4, 32] (2-bit planes) -> [n, 256]
        q = unpack(qs.reshape(n, 2, 32), [0, 2, 4, 6], 2, 3).reshape(n, QK_K)
        q = q.to(torch.int8) - 1
        return d * q.to(torch.float32)
