"""qwen4exp's MTP draft layer: `strata.models.mtp`'s head, with the trunk's hyper-connections.

transformers drops `mtp.*`, so nothing upstream defines how this block runs; this is the
design that treats it exactly like one more trunk block (llama.cpp stores it as one:
`blk.{n_layers}`), with the trunk's own conventions at both ends:

    h_p   = output_hc(x_p)                            the trunk's streams collapsed by its final
                                                      mixer: what the LM head reads (hidden wide)
    u     = eh_proj([enorm(embed(x_{p+1})) | hnorm(h_p)])
    s     = block(repeat(u, hc))                      u copied into hc streams, as the trunk copies
                                                      its embeddings; one hyper-connected block
                                                      (gated attention + MoE + shared expert)
    g     = hc_head(s)                                nextn.hc_head_{norm,down,up}: a final mixer
                                                      of its own, in place of a shared norm
    logits = output(g)                                predicts x_{p+2}

Chained drafts feed g back as the next h, as `MTPHead` does: g is what the head reads, as h_p is.
The block's attention is dense (its `attention.compress_ratios` entry is 0, as llama.cpp writes
MTP blocks) unless the file holds indexer tensors for it, which then prune like the trunk's QSA.

GGUF names beyond a trunk block's: `blk.N.nextn.eh_proj` (hidden, 2*hidden: embedding half
first), `nextn.enorm`, `nextn.hnorm` (hidden,; stored 1 + w), `nextn.hc_head_norm` (hc*hidden;
1 + w), `nextn.hc_head_down` (rank, hc*hidden), `nextn.hc_head_up` (hc*hidden, rank). HF names:
`mtp.fc_embedding`, `mtp.fc_hidden`, `mtp.pre_fc_norm_{embedding,hidden}`,
`mtp.hyper_connection_mixer.*`, `mtp.layers.0.*` (as `model.layers.i.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.models.hyper_connections import HyperConnection
from strata.models.mtp import MTPHead
from strata.models.weights import WeightLoader


class HyperMTPHead(MTPHead):
    """`MTPHead` whose block runs on hc streams and whose output is a hyper-connection mixer."""

    def load_norm(self, c, w: WeightLoader, p: str, output_norm: nn.Module | None) -> nn.Module:
        self.hc = c.hc_count
        return HyperConnection(w, f"{p}.hc_head", c.hidden_size, c.hc_count, c.hc_rank, c.rms_eps, inject=False)

    def fuse(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The fused input copied into every stream: (B, T, hc * hidden)."""
        return super().fuse(tokens, hidden).repeat(1, 1, self.hc)
