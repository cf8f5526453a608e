"""llama's format: `Config` read from config.json or GGUF metadata, the metadata writer, and the
HF q/k permutation (the model is `strata.models.llama`).

llama.cpp's converter permutes q/k rows so rotary pairs are adjacent (NORM rope mode);
the engine keeps that layout, so HF checkpoints get the same permutation at load.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from strata.formats.hparams import RopeConfig, decoder_from_gguf, decoder_from_hf, rope_frequencies
from strata.gguf.writer import decoder_metadata

ARCH = "llama"
HF_MODEL_TYPES = ("llama", "mistral", "mixtral")


@dataclass(frozen=True, slots=True)
class Config:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int
    rms_eps: float
    rope: RopeConfig
    context_length: int
    n_experts: int = 0
    n_experts_used: int = 0

    @classmethod
    def from_gguf(cls, meta: dict) -> "Config":
        a = ARCH
        base = decoder_from_gguf(meta, a)
        return cls(**base, ffn_size=meta[f"{a}.feed_forward_length"],
                   rope=RopeConfig.from_gguf(meta, a, meta.get(f"{a}.rope.dimension_count", base["head_dim"]),
                                             interleaved=True),
                   n_experts=meta.get(f"{a}.expert_count", 0),
                   n_experts_used=meta.get(f"{a}.expert_used_count", 0))

    @classmethod
    def from_hf(cls, cfg: dict) -> "Config":
        base = decoder_from_hf(cfg)
        return cls(**base, ffn_size=cfg["intermediate_size"],
                   rope=RopeConfig.from_hf(cfg, base["head_dim"], interleaved=True),
                   n_experts=cfg.get("num_local_experts", 0), n_experts_used=cfg.get("num_experts_per_tok", 0))


def gguf_metadata(c: Config) -> dict:
    extra = {"feed_forward_length": c.ffn_size}
    if c.n_experts:
        extra.update(expert_count=c.n_experts, expert_used_count=c.n_experts_used)
    return decoder_metadata(ARCH, c, **extra)


def rope_factors(c: Config) -> torch.Tensor | None:
    """llama.cpp stores llama3 rope scaling as per-frequency divisors in `rope_freqs.weight`."""
    if c.rope.scaling != "llama3":
        return None
    return rope_frequencies(replace(c.rope, scaling="default"))[0] / rope_frequencies(c.rope)[0]


def sanitize_hf(name: str, t: torch.Tensor, c: Config) -> torch.Tensor:
    """Permute HF q/k rows into llama.cpp's adjacent-pair rotary layout."""
    if name.endswith("attn_q.weight"):
        return _permute(t, c.n_heads)
    if name.endswith("attn_k.weight"):
        return _permute(t, c.n_kv_heads)
    return t


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
