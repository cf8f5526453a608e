"""The multi-token-prediction (MTP, "NextN") draft head of Qwen3-Next / DeepSeek-V3 style models.

One extra decoder block after the model predicts the token after next. At position p it reads
the model's last hidden state h_p (after the final norm: what the output head reads, as vLLM
and SGLang feed it) and the embedding of the next token x_{p+1}:

    u = eh_proj(concat(enorm(embed(x_{p+1})), hnorm(h_p)))     embedding first, hidden second
    g = shared_head_norm(block(u))                             one full-attention block, own KV cache
    logits = head(g)                                           predicts x_{p+2}

Drafting k tokens chains it: the first step reads the model's hidden state, later steps read
the head's own `g` and its own previous draft. `embed` and `head` are the model's token
embedding and output projection unless the file has the head's own.

GGUF names (llama.cpp's, the head as the block after the model's last, `blk.{n_layers}`, with
`{arch}.nextn_predict_layers` = 1 and `{arch}.block_count` counting it):

    blk.N.nextn.eh_proj            (hidden, 2 * hidden)
    blk.N.nextn.enorm, nextn.hnorm (hidden,)
    blk.N.nextn.shared_head_norm   (hidden,)  optional: the model's output_norm otherwise
    blk.N.nextn.embed_tokens       optional (vocab, hidden)
    blk.N.nextn.shared_head_head   optional (vocab, hidden)
    blk.N.attn_*, blk.N.ffn_*      the block, named like any other block of the architecture

Another architecture needs three things (qwen4exp does them, with `qwen4exp_mtp.HyperMTPHead`):

  * `Config.from_gguf`: n_layers = block_count - `{arch}.nextn_predict_layers` (and
    `gguf_metadata` writing both back), as qwen3next does;
  * `Model.__init__`: `self.mtp = load_mtp(self, w, make_block)`, with `make_block(i)` building
    block i the architecture's way (the model must have `config`, `seams`, `rope`, `tok_embd`, `output`
    and, unless the head brings its own, `output_norm`), before `w.finish`;
  * `model(tokens, cache, hidden=True)` returning (logits, h) with h every position's hidden
    state as the output head reads it (after the final norm: `DecoderLM.forward` does).

The engine then drafts with `model.mtp` (`--draft auto`). The head's own cache must roll back by
length, as attention caches do (`ModelCache.rollback`); a recurrent mixer in the head would
need its states kept across the k chained draft steps, which nothing does yet.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from strata.models.cache import ModelCache
from strata.models.layers import RMSNorm, Tap, no_tap
from strata.models.rope import Rope
from strata.models.weights import WeightLoader

REQUIRED = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


def mtp_prefix(config) -> str:
    """The head's block prefix: the block after the model's last."""
    return f"blk.{config.n_layers}"


class MTPHead(nn.Module):
    """`head(tokens, hidden, cache)` -> (logits, g): one draft step for each of T positions.

    `tokens` (B, T) are x_{p+1}, `hidden` (B, T, hidden) are h_p (the model's, or the head's
    own `g` when chaining); the cache (`new_cache`) is the block's KV cache, position p
    holding the pair (h_p, x_{p+1}), rolled back like the model's (`ModelCache.rollback`).
    """

    def __init__(self, config, w: WeightLoader, block: nn.Module, rope: Rope, embed: torch.Tensor,
                 output: torch.Tensor, output_norm: RMSNorm | None = None, kv_cache=None):
        """`kv_cache`: the model's KV-cache factory (`Seams.kv_cache`; None makes a `KVCache`)."""
        super().__init__()
        self.kv_cache = kv_cache
        c = config
        p = f"{mtp_prefix(c)}.nextn"
        hidden = c.hidden_size
        self.load_input(c, w, p)
        self.norm = self.load_norm(c, w, p, output_norm)
        own_embed = w.optional(f"{p}.embed_tokens.weight", (c.vocab_size, hidden))
        own_head = w.optional(f"{p}.shared_head_head.weight", (c.vocab_size, hidden))
        self.embed = own_embed if own_embed is not None else embed
        self.head = own_head if own_head is not None else output
        self.block = block
        self.rope = rope

    def load_input(self, c, w: WeightLoader, p: str) -> None:
        """The input fusion's weights (a subclass with another fusion overrides this and `fuse`)."""
        hidden = c.hidden_size
        self.eh_proj = w.dense(f"{p}.eh_proj.weight", (hidden, 2 * hidden))
        self.enorm = RMSNorm(w.dense(f"{p}.enorm.weight", (hidden,)), c.rms_eps)
        self.hnorm = RMSNorm(w.dense(f"{p}.hnorm.weight", (hidden,)), c.rms_eps)

    def load_norm(self, c, w: WeightLoader, p: str, output_norm: nn.Module | None) -> nn.Module:
        """What makes g from the block's output: its own norm, or the model's output norm."""
        norm = w.optional(f"{p}.shared_head_norm.weight", (c.hidden_size,))
        if norm is None and output_norm is None:
            raise ValueError("an MTP head without nextn.shared_head_norm needs the model's output_norm")
        return RMSNorm(norm, c.rms_eps) if norm is not None else output_norm

    def fuse(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """eh_proj(concat(enorm(embed(tokens)), hnorm(hidden))): the block's input (B, T, hidden)."""
        e = self.enorm(F.embedding(tokens, self.embed))
        return F.linear(torch.cat([e, self.hnorm(hidden.to(e.dtype))], dim=-1), self.eh_proj)

    def new_cache(self, batch: int = 1) -> ModelCache:
        return ModelCache([self.block.new_cache(self.kv_cache)], batch)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: ModelCache,
                n_new: torch.Tensor | None = None, last_only: bool = False, tap: Tap = no_tap):
        step = cache.step(tokens.shape[1], n_new)
        x = self.fuse(tokens, hidden)
        x = self.block(x, cache.layers[0], step, self.rope.cos_sin(step.positions), tap)
        cache.advance(step)
        if last_only:
            x = step.last_real(x)
        g = self.norm(x)
        return F.linear(g, self.head), g


def mtp_tensors_present(config, w: WeightLoader) -> str:
    """'complete', 'partial' (some of the head's tensors, not the ones it needs) or 'absent'."""
    prefix = mtp_prefix(config) + "."
    have = [n for n in w.source.names() if n.startswith(prefix)]
    if not have:
        return "absent"
    return "complete" if all(w.has(prefix + r) for r in REQUIRED) else "partial"


def load_mtp(model: nn.Module, w: WeightLoader, make_block: Callable[[int], nn.Module],
             head: type[MTPHead] = MTPHead) -> MTPHead | None:
    """The model's MTP head when the file has one (`blk.{n_layers}`), else None.

    `make_block(i)` builds block i the architecture's way (for Qwen3-Next: full attention and
    its MoE); `head` may be a subclass with another input fusion or output (`load_input`,
    `fuse`, `load_norm`). A file holding only part of the head (a stripped or foreign checkpoint)
    loads without it: `model.mtp_skipped` says why, and its tensors are left for `w.finish` to ignore
    under `mtp_prefix(config)`.
    """
    c = model.config
    state = mtp_tensors_present(c, w)
    model.mtp_skipped = None
    if state == "absent":
        return None
    if state == "partial":
        missing = [r for r in REQUIRED if not w.has(f"{mtp_prefix(c)}.{r}")]
        model.mtp_skipped = f"incomplete MTP layer {mtp_prefix(c)} (no {', '.join(missing)}); drafting is off"
        return None
    return head(c, w, make_block(c.n_layers), model.rope, model.tok_embd, model.output,
                getattr(model, "output_norm", None), model.seams.kv_cache)
