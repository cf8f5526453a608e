"""Rotary position embeddings with the scaling variants the supported models use."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class RopeConfig:
    dim: int  # rotated dimensions per head (partial rotary rotates fewer than head_dim)
    theta: float = 10000.0
    interleaved: bool = False  # llama.cpp's NORM mode (adjacent pairs) vs NEOX (halves)
    scaling: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_factors: tuple[float, ...] | None = field(default=None, compare=False)

    @classmethod
    def from_hf(cls, cfg: dict, dim: int, interleaved: bool = False) -> "RopeConfig":
        """Reads both transformers 5's `rope_parameters` and the older `rope_scaling`."""
        params = dict(cfg.get("rope_parameters") or {})
        params.update(cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        return cls(dim=dim, theta=float(theta), interleaved=interleaved, scaling=kind,
                   factor=float(params.get("factor", 1.0)),
                   original_context=int(params.get("original_max_position_embeddings") or 0),
                   low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   beta_fast=float(params.get("beta_fast", 32.0)),
                   beta_slow=float(params.get("beta_slow", 1.0)))

    @classmethod
    def from_gguf(cls, meta: dict, arch: str, dim: int, interleaved: bool,
                  freq_factors: torch.Tensor | None = None) -> "RopeConfig":
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        kind = {"none": "default", "": "default"}.get(kind, kind)
        if freq_factors is not None:
            kind = "factors"
        return cls(dim=dim, theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
                   interleaved=interleaved, scaling=kind,
                   factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
                   original_context=int(meta.get(f"{arch}.rope.scaling.original_context_length", 0)),
                   freq_factors=None if freq_factors is None else tuple(freq_factors.tolist()))


class Rope:
    """Precomputed inverse frequencies; `apply` rotates q or k of shape (B, T, H, D)."""

    def __init__(self, cfg: RopeConfig):
        self.cfg = cfg
        self.inv_freq, self.attention_factor = _inv_freq(cfg)

    def cos_sin(self, positions: torch.Tensor):  # (B, T) -> 2 x (B, T, 1, dim/2)
        freqs = positions[..., None].float() * self.inv_freq
        return (freqs.cos() * self.attention_factor)[:, :, None], (freqs.sin() * self.attention_factor)[:, :, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        d = self.cfg.dim
        rot, rest = x[..., :d], x[..., d:]
        if self.cfg.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., : d // 2], rot[..., d // 2:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def _inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    base = 1.0 / (cfg.theta ** (torch.arange(0, cfg.dim, 2, dtype=torch.int64).float() / cfg.dim))
    if cfg.scaling == "linear":
        return base / cfg.factor, 1.0
    if cfg.scaling == "factors":
        return base / torch.tensor(cfg.freq_factors, dtype=torch.float32), 1.0
    if cfg.scaling == "llama3":
        return _llama3(base, cfg), 1.0
    if cfg.scaling == "yarn":
        return _yarn(base, cfg)
    return base, 1.0


def _llama3(inv_freq: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    old = cfg.original_context
    low_wavelen = old / cfg.low_freq_factor
    high_wavelen = old / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base, factor = cfg.dim, cfg.theta, cfg.factor
    old = cfg.original_context or 4096

    def correction_dim(rotations):
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv, attention_factor
