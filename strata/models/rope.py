"""Rotary position embeddings with the scaling variants the supported models use."""

from __future__ import annotations

import torch

from strata.formats.hparams import RopeConfig, rope_frequencies
from strata.kernels import decode_ops


class Rope:
    """Precomputed inverse frequencies; `apply` rotates q or k of shape (B, T, H, D)."""

    def __init__(self, cfg: RopeConfig):
        self.cfg = cfg
        self.inv_freq, self.attention_factor = rope_frequencies(cfg)

    def cos_sin(self, positions: torch.Tensor):  # (B, T) -> 2 x (B, T, 1, dim/2)
        freqs = positions[..., None].float() * self.inv_freq
        return (freqs.cos() * self.attention_factor)[:, :, None], (freqs.sin() * self.attention_factor)[:, :, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates in float32 (the tables are float32, as transformers keeps them) and returns x's
        dtype, so bf16/fp16 q and k stay in the dtype v and the cache have."""
        d = self.cfg.dim
        y = decode_ops.try_rope(x, cos, sin, d, self.cfg.interleaved)  # one C call
        if y is not None:
            return y
        rot, rest = x[..., :d].float(), x[..., d:]
        if self.cfg.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        out = out.to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
