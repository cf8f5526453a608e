"""qwen3moe's format: `Config` read from config.json or GGUF metadata and the metadata writer
(the model is `strata.models.qwen3moe`)."""

from __future__ import annotations

from dataclasses import dataclass

from strata.formats.hparams import RopeConfig, decoder_from_gguf, decoder_from_hf
from strata.gguf.writer import decoder_metadata

ARCH = "qwen3moe"
HF_MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True, slots=True)
class Config:
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_size: int  # dense layers (mlp_only_layers)
    expert_ffn_size: int
    n_experts: int
    n_experts_used: int
    norm_topk_prob: bool
    rms_eps: float
    rope: RopeConfig
    context_length: int
    dense_layers: tuple[int, ...] = ()

    @classmethod
    def from_gguf(cls, meta: dict) -> "Config":
        a = ARCH
        base = decoder_from_gguf(meta, a, default_eps=1e-6, default_ctx=32768)
        return cls(**base, ffn_size=meta.get(f"{a}.feed_forward_length", 0),
                   expert_ffn_size=meta[f"{a}.expert_feed_forward_length"],
                   n_experts=meta[f"{a}.expert_count"], n_experts_used=meta[f"{a}.expert_used_count"],
                   # llama.cpp always renormalises qwen3moe's top-k weights
                   norm_topk_prob=bool(meta.get(f"{a}.expert_weights_norm", True)),
                   rope=RopeConfig.from_gguf(meta, a, meta.get(f"{a}.rope.dimension_count", base["head_dim"]),
                                             interleaved=False))

    @classmethod
    def from_hf(cls, cfg: dict) -> "Config":
        base = decoder_from_hf(cfg, default_eps=1e-6, default_ctx=32768)
        n_layers = base["n_layers"]
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = tuple(i for i in range(n_layers)
                      if i in (cfg.get("mlp_only_layers") or []) or (i + 1) % step != 0)
        return cls(**base, ffn_size=cfg.get("intermediate_size", 0), expert_ffn_size=cfg["moe_intermediate_size"],
                   n_experts=cfg.get("num_experts") or cfg["num_local_experts"],
                   n_experts_used=cfg["num_experts_per_tok"],
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   rope=RopeConfig.from_hf(cfg, base["head_dim"]), dense_layers=dense)


def gguf_metadata(c: Config) -> dict:
    return decoder_metadata(ARCH, c, feed_forward_length=c.ffn_size, expert_feed_forward_length=c.expert_ffn_size,
                            expert_count=c.n_experts, expert_used_count=c.n_experts_used,
                            expert_weights_norm=c.norm_topk_prob)
