"""qwen3moe: Qwen3-30B-A3B and kin. Per-head q/k RMS norms, NEOX rope, softmax top-k router."""

from __future__ import annotations

from functools import partial

from strata.formats.qwen3moe import Config
from strata.models.layers import Attention, DenseFFN, Experts, softmax_topk
from strata.models.rope import Rope
from strata.models.seams import Seams
from strata.models.transformer import Block, DecoderLM, MoE
from strata.models.weights import WeightLoader


class Model(DecoderLM):
    def __init__(self, c: Config, w: WeightLoader, seams: Seams = Seams()):
        rope = Rope(c.rope)
        blocks = [self._block(c, w, i, rope, seams) for i in range(c.n_layers)]
        super().__init__(c, w, blocks, rope, c.rms_eps, seams)
        w.finish()

    @staticmethod
    def _block(c: Config, w: WeightLoader, i: int, rope: Rope, seams: Seams) -> Block:
        p = f"blk.{i}"
        attn = Attention(w, p, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, rope, c.rms_eps,
                         qk_norm=True)
        if i in c.dense_layers or not w.has(f"{p}.ffn_gate_inp.weight"):
            ffn = DenseFFN(w, p, c.hidden_size, c.ffn_size)
        else:
            k, norm = c.n_experts_used, c.norm_topk_prob
            ffn = MoE(w.dense(f"{p}.ffn_gate_inp.weight", (c.n_experts, c.hidden_size)),
                      Experts(w, p, c.n_experts, c.hidden_size, c.expert_ffn_size, layer=i, provider=seams.experts),
                      route=partial(softmax_topk, k=k, normalize=norm))
        return Block.from_weights(w, p, c.hidden_size, c.rms_eps, attn, ffn)
