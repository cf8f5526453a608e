"""Hyper-parameters every decoder architecture reads the same way, from GGUF or HF config.

Architecture formats (`strata.formats.<arch>`) add their own fields (experts, rope style,
recurrent layers) on top. `RopeConfig` is the rotary settings both sources describe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def decoder_from_gguf(meta: dict, arch: str, default_eps: float = 1e-5, default_ctx: int = 4096) -> dict:
    hidden = meta[f"{arch}.embedding_length"]
    n_heads = meta[f"{arch}.attention.head_count"]
    return dict(vocab_size=meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
                hidden_size=hidden, n_layers=meta[f"{arch}.block_count"], n_heads=n_heads,
                n_kv_heads=meta.get(f"{arch}.attention.head_count_kv", n_heads),
                head_dim=meta.get(f"{arch}.attention.key_length", hidden // n_heads),
                rms_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", default_eps),
                context_length=meta.get(f"{arch}.context_length", default_ctx))


def decoder_from_hf(cfg: dict, default_eps: float = 1e-5, default_ctx: int = 4096) -> dict:
    hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return dict(vocab_size=cfg["vocab_size"], hidden_size=hidden, n_layers=cfg["num_hidden_layers"],
                n_heads=n_heads, n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
                head_dim=cfg.get("head_dim") or hidden // n_heads,
                rms_eps=cfg.get("rms_norm_eps", default_eps),
                context_length=cfg.get("max_position_embeddings", default_ctx))


def gated_deltanet_from_gguf(meta: dict, arch: str) -> dict:
    """The Gated DeltaNet fields qwen3next and qwen4exp share (llama.cpp's `ssm.*` keys)."""
    v_heads = meta[f"{arch}.ssm.time_step_rank"]
    return dict(conv_kernel=meta[f"{arch}.ssm.conv_kernel"], linear_k_heads=meta[f"{arch}.ssm.group_count"],
                linear_v_heads=v_heads, linear_k_dim=meta[f"{arch}.ssm.state_size"],
                linear_v_dim=meta[f"{arch}.ssm.inner_size"] // v_heads)


def gated_deltanet_from_hf(cfg: dict) -> dict:
    return dict(conv_kernel=cfg.get("linear_conv_kernel_dim", 4), linear_k_heads=cfg["linear_num_key_heads"],
                linear_v_heads=cfg["linear_num_value_heads"], linear_k_dim=cfg["linear_key_head_dim"],
                linear_v_dim=cfg["linear_value_head_dim"])


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


def rope_frequencies(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and attention factor the rope settings give (llama3 and YaRN scaled)."""
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
