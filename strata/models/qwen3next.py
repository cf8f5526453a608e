"""qwen3next: Qwen3-Next (HF `Qwen3NextForCausalLM`), a hybrid of Gated DeltaNet and gated attention.

Layers alternate between linear attention (`GatedDeltaNet`, with a recurrent state) and full
attention every `full_attention_interval`-th layer. Full attention is gated (`attn_q` holds, per
head, the query then an output gate: out *= sigmoid(gate)), has q/k RMS norms and NEOX rope on the
first `partial_rotary_factor` of each head. Every FFN is a softmax top-k MoE with renormalised
weights plus a shared expert scaled by sigmoid(`ffn_gate_inp_shexp` . x). All RMSNorms but the
DeltaNet's gated one are zero-centred in HF (x * (1 + w)).

The GGUF layout, metadata, config readers and HF names are in `strata.formats.qwen3next`.
"""

from __future__ import annotations

from functools import partial

from strata.formats.qwen3next import Config
from strata.models.gated_deltanet import GatedDeltaNet
from strata.models.layers import Attention, DenseFFN, Experts, RMSNorm, SharedExpert, softmax_topk
from strata.models.mtp import load_mtp, mtp_prefix
from strata.models.rope import Rope
from strata.models.seams import Seams
from strata.models.transformer import Block, DecoderLM, MoE
from strata.models.weights import WeightLoader


class Model(DecoderLM):
    def __init__(self, c: Config, w: WeightLoader, seams: Seams = Seams()):
        rope = Rope(c.rope)
        blocks = [self._block(c, w, i, rope, seams) for i in range(c.n_layers)]
        super().__init__(c, w, blocks, rope, c.rms_eps, seams)
        # the MTP draft head: full attention, like the layer HF builds for it
        self.mtp = load_mtp(self, w, lambda i: self._block(c, w, i, rope, seams, recurrent=False))
        w.finish(ignore=("hf:mtp.",) + ((mtp_prefix(c) + ".",) if self.mtp_skipped else ()))

    @staticmethod
    def _block(c: Config, w: WeightLoader, i: int, rope: Rope, seams: Seams, recurrent: bool | None = None) -> Block:
        p = f"blk.{i}"
        if c.recurrent[i] if recurrent is None else recurrent:
            mixer = GatedDeltaNet(w, p, c.hidden_size, c.linear_k_heads, c.linear_v_heads, c.linear_k_dim,
                                  c.linear_v_dim, c.conv_kernel, c.rms_eps)
        else:
            mixer = Attention(w, p, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, rope, c.rms_eps,
                              qk_norm=True, gated=True)
        if i in c.dense_layers or not w.has(f"{p}.ffn_gate_inp.weight"):
            ffn = DenseFFN(w, p, c.hidden_size, c.ffn_size)
        else:
            k, norm = c.n_experts_used, c.norm_topk_prob
            shared = None
            if w.has(f"{p}.ffn_up_shexp.weight"):
                shared = SharedExpert(w, p, c.hidden_size, c.shared_ffn_size)
            ffn = MoE(w.dense(f"{p}.ffn_gate_inp.weight", (c.n_experts, c.hidden_size)),
                      Experts(w, p, c.n_experts, c.hidden_size, c.expert_ffn_size, layer=i, provider=seams.experts),
                      route=partial(softmax_topk, k=k, normalize=norm), shared=shared)
        return Block(RMSNorm(w.dense(f"{p}.attn_norm.weight", (c.hidden_size,)), c.rms_eps), mixer,
                     RMSNorm(w.dense(f"{p}.post_attention_norm.weight", (c.hidden_size,)), c.rms_eps), ffn)
