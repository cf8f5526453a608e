"""llama: dense Llama/Mistral and Mixtral-style MoE (`ffn_*_exps`), as llama.cpp writes them.

llama.cpp's converter permutes q/k rows so rotary pairs are adjacent (NORM rope mode);
the engine keeps that layout, so HF checkpoints get the same permutation at load.
"""

from __future__ import annotations

from functools import partial

from dataclasses import replace

from strata.formats.llama import Config
from strata.models.layers import Attention, DenseFFN, Experts, softmax_topk
from strata.models.rope import Rope
from strata.models.seams import Seams
from strata.models.transformer import Block, DecoderLM, MoE
from strata.models.weights import WeightLoader


class Model(DecoderLM):
    def __init__(self, c: Config, w: WeightLoader, seams: Seams = Seams()):
        factors = w.optional("rope_freqs.weight", (c.rope.dim // 2,))  # llama3 scaling, precomputed
        if factors is not None:
            c = replace(c, rope=replace(c.rope, scaling="factors", freq_factors=tuple(factors.tolist())))
        rope = Rope(c.rope)
        blocks = [self._block(c, w, i, rope, seams) for i in range(c.n_layers)]
        super().__init__(c, w, blocks, rope, c.rms_eps, seams)
        w.finish()

    @staticmethod
    def _block(c: Config, w: WeightLoader, i: int, rope: Rope, seams: Seams) -> Block:
        p = f"blk.{i}"
        attn = Attention(w, p, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, rope, c.rms_eps,
                         bias=True)
        if c.n_experts:
            k = c.n_experts_used
            ffn = MoE(w.dense(f"{p}.ffn_gate_inp.weight", (c.n_experts, c.hidden_size)),
                      Experts(w, p, c.n_experts, c.hidden_size, c.ffn_size, layer=i, provider=seams.experts),
                      route=partial(softmax_topk, k=k, normalize=True))
        else:
            ffn = DenseFFN(w, p, c.hidden_size, c.ffn_size)
        return Block.from_weights(w, p, c.hidden_size, c.rms_eps, attn, ffn)
