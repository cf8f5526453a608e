"""Hyper-connections: a residual `hc` streams wide, mixed into one block input by a low-rank gate.

The residual is (B, T, hc * hidden), stream s at [s*hidden, (s+1)*hidden). Before a block:

    xn    = grouped_rms_norm(x) * norm          (each stream normalised on its own; norm spans hc*hidden)
    gate  = sigmoid(up(silu(down(xn) / hc)))    (hc*hidden -> rank -> hc*hidden)
    mixed = mean over streams of gate * xn      (the block's input, hidden wide)
    w     = 2 * sigmoid(inject(xn) / hc)        (one weight per stream)

and after it every stream adds the block's output scaled by its own weight: x_s + w_s * out.
The residual itself is never normalised; only the block input is. The final mixer (no inject)
takes the place of the output norm.

Weights, llama.cpp's names: `blk.N.hc_attn_{norm,down,up,inject}`, `blk.N.hc_ffn_{...}` and
`output_hc_{norm,down,up}`; the norm is zero-centred in HF and stored as 1 + w.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.kernels import f16
from strata.models.linear import Linear
from strata.models.weights import WeightLoader


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """RMS norm of each `group`-wide slice of the last dim (fp32), times `weight` over the whole width."""
    xf = x.float()
    shape = xf.shape
    xf = xf.reshape(*shape[:-1], -1, group)
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).reshape(shape)
    return (xf * weight.float()).to(x.dtype)


class HyperConnection(nn.Module):
    """One hyper-connection mixer; `inject=False` for the final one (it only mixes)."""

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, hc: int, rank: int, eps: float,
                 inject: bool = True):
        super().__init__()
        self.hidden, self.hc, self.eps = hidden, hc, eps
        width = hc * hidden
        self.norm = w.dense(f"{prefix}_norm.weight", (width,))
        self.down = w.linear(f"{prefix}_down.weight", (rank, width))  # kept as stored (F16 or blocks)
        self.up = w.linear(f"{prefix}_up.weight", (width, rank))
        self.inject = w.linear(f"{prefix}_inject.weight", (hc, width)) if inject else None

    @property
    def _f16_weights(self) -> tuple | None:
        """(down, up, inject or None) as plain float16 tensors, or None (quantized, moved, biased)."""
        lins = (self.down, self.up) if self.inject is None else (self.down, self.up, self.inject)
        if not all(type(lin) is Linear and lin.bias is None and not lin.quantized
                   and lin.weight.dtype is torch.float16 for lin in lins):
            return None
        return self.down.weight, self.up.weight, None if self.inject is None else self.inject.weight

    def mix(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (..., hc*hidden) -> (block input (..., hidden), per-stream weights (..., hc) or None).

        Float16 weights (as the flagship stores them) and decode-sized x on the CPU: one C call
        (`kernels.f16.try_hc_mix`); else the torch form below, which it computes."""
        weights = self._f16_weights
        if weights is not None:
            fast = f16.try_hc_mix(x, self.norm, *weights, self.hc, self.hidden, self.eps)
            if fast is not None:
                return fast
        xn = grouped_rms_norm(x, self.norm, self.hidden, self.eps)
        gate = torch.sigmoid(F.linear(F.silu(F.linear(xn, self.down) / self.hc), self.up))
        streams = (gate * xn).unflatten(-1, (self.hc, self.hidden))
        mixed = streams.mean(dim=-2)
        if self.inject is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(F.linear(xn, self.inject) / self.hc)

    def ungated(self, x: torch.Tensor) -> torch.Tensor:
        """The block input with the gate taken as uniform: mean over streams of the normalised x.

        A router prediction (the tiers' prefetch of the next layer's experts) uses this: it skips
        the down/up products, two thirds of a mix's bytes, and a linear router's ranking only moves
        by the gate's departure from uniform. Never used for the block's own output."""
        xn = grouped_rms_norm(x, self.norm, self.hidden, self.eps)
        return xn.unflatten(-1, (self.hc, self.hidden)).mean(dim=-2)

    @staticmethod
    def combine(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every stream of the residual x adds the block output `out`, scaled by its weight."""
        return x + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)[0]
