"""qwen3moe: Qwen3-30B-A3B and kin. Per-head q/k RMS norms, NEOX rope, softmax top-k router."""

from __future__ import annotations

from dataclasses import dataclass

from strata.gguf.writer import decoder_metadata
from strata.models.hparams import decoder_from_gguf, decoder_from_hf
from strata.models.layers import Attention, DenseFFN, Experts, softmax_topk
from strata.models.rope import Rope, RopeConfig
from strata.models.transformer import Block, DecoderLM, MoE
from strata.models.weights import WeightLoader

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


class Model(DecoderLM):
    def __init__(self, c: Config, w: WeightLoader):
        rope = Rope(c.rope)
        blocks = [self._block(c, w, i, rope) for i in range(c.n_layers)]
        super().__init__(c, w, blocks, rope, c.rms_eps)
        w.finish()

    @staticmethod
    def _block(c: Config, w: WeightLoader, i: int, rope: Rope) -> Block:
        p = f"blk.{i}"
        attn = Attention(w, p, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, rope, c.rms_eps,
                         qk_norm=True)
        if i in c.dense_layers or not w.has(f"{p}.ffn_gate_inp.weight"):
            ffn = DenseFFN(w, p, c.hidden_size, c.ffn_size)
        else:
            k, norm = c.n_experts_used, c.norm_topk_prob
            ffn = MoE(w.dense(f"{p}.ffn_gate_inp.weight", (c.n_experts, c.hidden_size)),
                      Experts(w, p, c.n_experts, c.hidden_size, c.expert_ffn_size, layer=i),
                      route=lambda logits: softmax_topk(logits, k, normalize=norm))
        return Block.from_weights(w, p, c.hidden_size, c.rms_eps, attn, ffn)
