"""qwen4exp: Qwen4-Exp text model (HF `Qwen4ExpForCausalLM`, model_type `qwen4_exp[_text]`).

A Qwen3-Next-style hybrid with three additions:

  * hyper-connections (`hyper_connections.py`): the residual is `hc` streams wide; before the
    mixer and before the MoE a low-rank gated mixer makes the block input, and each stream adds
    the block output with its own weight. There is no layer norm: the final mixer is the
    output norm.
  * QSA (`qsa.py`): the full-attention layers keep, per query, the best `budget // ratio` blocks
    of `ratio` tokens (scored by a small indexer) plus the incomplete tail; exactly dense while
    a query has no more complete blocks than that.
  * PLE: on the layer(s) the config names, an n-gram hash embedding (its table read from disk row
    by row by the `table_reader` passed in, `strata/tiers/ngram_table.py`) gates a value into
    every stream, plus a dilated causal conv.

The rest: Gated DeltaNet layers (`gated_deltanet.py`; the output gate is sigmoid when the config
says so), gated attention with zero-centred q/k norms and partial NEOX rope, and a softmax
top-k MoE (renormalised) plus a shared expert scaled by sigmoid(`ffn_gate_inp_shexp` . x).

The GGUF layout, the metadata, the config readers and the HF name table are in
`strata.formats.qwen4exp`; the PLE layer's caches are `strata.models.cache.PLECache`/`LayerCache`.
"""

from __future__ import annotations

import logging

import math

import torch
import torch.nn.functional as F
from torch import nn

from strata.formats.ngram_hash import TABLE
from strata.kernels import decode_ops
from strata.kernels.gpu.graphs import boundary
from strata.formats.qwen4exp import Config, check_hash_buffers, tile_value_heads, untile_value_heads
from strata.models.cache import LayerCache, ModelCache, PLECache, StepInfo
from strata.models.gated_deltanet import GatedDeltaNet, GDNCache
from strata.models.hyper_connections import HyperConnection, grouped_rms_norm
from strata.models.layers import Experts, SharedExpert, Tap, no_tap, softmax_topk
from strata.models.linear import InputPermutedLinear, Linear
from strata.models.mtp import load_mtp
from strata.models.qsa import QSAAttention, QSAIndexer
from strata.models.qwen4exp_mtp import HyperMTPHead
from strata.models.rope import Rope
from strata.models.seams import Seams
from strata.models.transformer import MoE, _prefixed
from strata.models.weights import WeightLoader


log = logging.getLogger(__name__)

class TiledGatedDeltaNet(GatedDeltaNet):
    """`GatedDeltaNet` over weights in llama.cpp's tiled value-head order, regrouped at load."""

    def __init__(self, c: Config, w: WeightLoader, prefix: str):
        super().__init__(w, prefix, c.hidden_size, c.linear_k_heads, c.linear_v_heads, c.linear_k_dim,
                         c.linear_v_dim, c.conv_kernel, c.rms_eps, gate_act=c.gate_act)
        key_dim, dv = self.key_dim, c.linear_v_dim
        # rows are regrouped as stored (blocks stay blocks); ssm_out's columns cannot be, so its
        # input is put back in the file's order instead
        untile = lambda rows, head: [untile_value_heads(rows, 0, c, head)]  # noqa: E731
        self.wqkv = self.wqkv.split_rows(lambda rows: [torch.cat([rows[:2 * key_dim],
                                                                  untile_value_heads(rows[2 * key_dim:], 0, c, dv)])])[0]
        self.conv_w = torch.cat([self.conv_w[:2 * key_dim], untile_value_heads(self.conv_w[2 * key_dim:], 0, c, dv)])
        self.wz = self.wz.split_rows(lambda rows: untile(rows, dv))[0]
        self.wb, self.wa = (lin.split_rows(lambda rows: untile(rows, 1))[0] for lin in (self.wb, self.wa))
        self.dt_bias, self.a = untile_value_heads(self.dt_bias, 0, c, 1), untile_value_heads(self.a, 0, c, 1)
        order = tile_value_heads(torch.arange(self.value_dim), 0, c, dv)
        self.wo = InputPermutedLinear(self.wo.weight, order, self.wo.bias, self.wo.name)


class PLE(nn.Module):
    """Per-layer n-gram embedding: the embedding gates one value per stream, plus a dilated conv."""

    def __init__(self, c: Config, w: WeightLoader, prefix: str):
        super().__init__()
        h, width, e = c.hidden_size, c.hc_count * c.hidden_size, c.ple_embed_dim
        self.hidden, self.hc, self.eps = h, c.hc_count, c.rms_eps
        self.kernel, self.dilation = c.ple_conv_kernel, c.ple_hash.ngram_size
        self.state_len = (self.kernel - 1) * self.dilation
        self.key = w.linear(f"{prefix}.ple_key.weight", (width, e))
        self.value = w.linear(f"{prefix}.ple_value.weight", (h, e))
        self.norm_key = w.dense(f"{prefix}.ple_norm_key.weight", (width,))
        self.norm_query = w.dense(f"{prefix}.ple_norm_query.weight", (width,))
        self.norm_conv = w.dense(f"{prefix}.ple_norm_conv.weight", (width,))
        self.conv = w.dense(f"{prefix}.ple_conv1d.weight", (width, self.kernel))

    def forward(self, x: torch.Tensor, emb: torch.Tensor, cache: PLECache, step: StepInfo) -> torch.Tensor:
        key = grouped_rms_norm(F.linear(emb, self.key), self.norm_key, self.hidden, self.eps)
        query = grouped_rms_norm(x, self.norm_query, self.hidden, self.eps)
        gate = (key.unflatten(-1, (self.hc, self.hidden)) * query.unflatten(-1, (self.hc, self.hidden))).sum(
            -1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * F.linear(emb, self.value).unsqueeze(-2)  # (B, T, hc, hidden)
        normed = grouped_rms_norm(gated.flatten(-2), self.norm_conv, self.hidden, self.eps)
        return gated.flatten(-2) + F.silu(self._conv(normed, cache, step.n_new.to(x.device, non_blocking=True)))

    def _conv(self, x: torch.Tensor, cache: PLECache, n_new: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv dilated by the n-gram size over [state, x]; keeps each row's last
        (K-1)*dilation real inputs as its state."""
        b, t, ch = x.shape
        s = self.state_len
        if cache.conv is None:
            cache.conv = x.new_zeros(b, s, ch)
        full = torch.cat([cache.conv.to(x.dtype), x], dim=1)
        out = None
        for k in range(self.kernel):
            start = s - (self.kernel - 1 - k) * self.dilation
            term = full[:, start:start + t] * self.conv[:, k]
            out = term if out is None else out + term
        idx = n_new[:, None] + torch.arange(s, device=x.device)
        cache.conv = full.gather(1, idx[..., None].expand(-1, -1, ch))
        if cache.tracking:
            cache.window = full
        return out


class Block(nn.Module):
    """[PLE], hyper-connected mixer (Gated DeltaNet or QSA), hyper-connected MoE."""

    def __init__(self, c: Config, w: WeightLoader, i: int, rope: Rope, seams: Seams):
        super().__init__()
        p, h = f"blk.{i}", c.hidden_size
        self.attn_hc = HyperConnection(w, f"{p}.hc_attn", h, c.hc_count, c.hc_rank, c.rms_eps)
        self.ffn_hc = HyperConnection(w, f"{p}.hc_ffn", h, c.hc_count, c.hc_rank, c.rms_eps)
        self.ple = PLE(c, w, p) if i in c.ple_layers else None
        mtp = i >= c.n_layers  # the MTP block: attention, pruned as the trunk's QSA if it has an indexer
        ratio = max(c.compress_ratios, default=0) if mtp else c.compress_ratios[i]
        if not mtp and c.recurrent[i]:
            self.attn = TiledGatedDeltaNet(c, w, p)
        else:
            indexer = None
            if ratio and w.has(f"{p}.indexer.q_proj.weight"):
                indexer = QSAIndexer(w, p, h, c.indexer_heads, c.indexer_dim, c.indexer_budget,
                                     ratio, rope, c.rms_eps)
            self.attn = QSAAttention(w, p, h, c.n_heads, c.n_kv_heads, c.head_dim, rope, c.rms_eps, indexer)
        k, norm = c.n_experts_used, c.norm_topk_prob
        self.ffn = MoE(w.dense(f"{p}.ffn_gate_inp.weight", (c.n_experts, h)),
                       Experts(w, p, c.n_experts, h, c.expert_ffn_size, layer=i, provider=seams.experts),
                       route=lambda logits: softmax_topk(logits, k, normalize=norm),
                       shared=SharedExpert(w, p, h, c.shared_ffn_size))
        self.ffn_norm = self.ffn_hc  # hidden state -> MoE input, for the tiers' router prefetch

    def new_cache(self, kv_cache=None):
        mixer = self.attn.new_cache(kv_cache)
        return LayerCache(mixer, PLECache()) if self.ple is not None else mixer

    def forward(self, x, cache, step: StepInfo, rope_cs, tap: Tap = no_tap, ple_emb=None) -> torch.Tensor:
        if self.ple is not None:
            x = x + self.ple(x, ple_emb.to(x.device), cache.ple, step)
            cache = cache.mixer
        mixed, weights = self.attn_hc.mix(x)
        y = None
        if tap is no_tap and type(self.attn) is TiledGatedDeltaNet and type(cache) is GDNCache:
            y = decode_ops.try_gdn_mixer(mixed, self.attn, cache, step)  # decode tokens: one C call
        x = HyperConnection.combine(x, self.attn(mixed, cache, step, rope_cs, tap) if y is None else y, weights)
        tap("ffn_inp", x)
        mixed, weights = self.ffn_hc.mix(x)
        out = self.ffn(mixed, None if step.all_real else step.token_mask.to(x.device, non_blocking=True), tap)
        tap("ffn_moe_out", out)
        return HyperConnection.combine(x, out, weights)


class Model(nn.Module):
    """Embedding copied into hc streams, blocks, the output mixer, the LM head.

    `ple_table` (an `NgramTable`) reads the n-gram rows; `ple_table.stats()` reports its reads.
    """

    def __init__(self, c: Config, w: WeightLoader, seams: Seams = Seams()):
        """`seams` (`strata.models.seams`): the experts provider, KV-cache factory and placement, and
        `seams.table_reader(source, hash, row_dim, rows)`, which opens the n-gram table (the tiers'
        `open_table`); a model with a PLE layer needs one."""
        super().__init__()
        self.config = c
        self.seams = seams
        self.tok_embd = w.embedding("token_embd.weight", (c.vocab_size, c.hidden_size))
        self.rope = Rope(c.rope)
        self.blocks = nn.ModuleList([Block(c, w, i, self.rope, seams) for i in range(c.n_layers)])
        self.output_mixer = HyperConnection(w, "output_hc", c.hidden_size, c.hc_count, c.hc_rank, c.rms_eps,
                                            inject=False)
        self.output = w.linear("output.weight", (c.vocab_size, c.hidden_size)) if w.has("output.weight") \
            else Linear(self.tok_embd.weight)
        self.ple_layer = c.ple_layers[0] if c.ple_layers else None
        self.ple_hash = c.ple_hash
        self.ple_table = None
        if self.ple_layer is not None:
            if seams.table_reader is None:
                raise ValueError("a qwen4exp model with a PLE layer needs a table_reader")
            check_hash_buffers(w.source, c)
            self.ple_table = seams.table_reader(w.source, c.ple_hash, c.ple_row_dim, c.ple_rows)
        # the MTP draft head (`qwen4exp_mtp`): block n_layers; a file with only part of it loads without
        self.mtp = load_mtp(self, w, lambda i: Block(c, w, i, self.rope, seams), head=HyperMTPHead)
        skipped = () if self.mtp is not None else tuple(f"blk.{c.n_layers + k}." for k in range(c.nextn_layers))
        # llama.cpp's converter writes compress_ratios 0 for "indexed_attention" layers and their indexer
        # tensors too; llama.cpp then attends densely (exact within the budget) and so does Strata
        dense = tuple(f"blk.{i}.indexer." for i in range(c.n_layers) if not c.recurrent[i] and not c.compress_ratios[i])
        if any(w.has(f"{d}q_proj.weight") for d in dense):
            log.warning("compress_ratios are 0 on layers with indexer tensors: those layers attend to every token "
                        "(as llama.cpp does with this file), not to the QSA budget")
        w.finish(ignore=(TABLE, *skipped, *dense, "hf:mtp.", "hf:model.mtp."))

    def new_cache(self, batch: int = 1) -> ModelCache:
        return ModelCache([b.new_cache(self.seams.kv_cache) for b in self.blocks], batch)

    @boundary  # host work (hashing, reads): compiled decode steps run it eagerly (kernels/gpu/graphs.py)
    def _start_ple(self, tokens: torch.Tensor, cache: ModelCache, step: StepInfo):
        """Hash this step's tokens and start reading their rows; the PLE layer waits for them."""
        state = cache.layers[self.ple_layer].ple
        context = state.context if state.context is not None else self.ple_hash.initial_context(tokens.shape[0])
        rows = self.ple_hash.rows(tokens.cpu(), context)
        state.context = self.ple_hash.next_context(context, tokens.cpu(), step.n_new)
        if state.tracking:
            state.undo = (context, tokens.cpu(), step.n_new)
        real = step.token_mask
        self.ple_table.count_tokens(int(real.sum()))
        return self.ple_table.request(rows[real]), real

    @boundary  # waits for the host reads
    def _ple_rows(self, pending, x: torch.Tensor, shape, step: StepInfo) -> torch.Tensor:
        """The PLE rows `_start_ple` asked for, (B, T, ple_embed_dim) on x's device; zero at padding."""
        reads, real = pending
        rows = reads.result(x.dtype).flatten(-2).to(x.device, non_blocking=True)  # host rows: no read back
        if step.all_real:
            return rows.reshape(*shape, self.config.ple_embed_dim)
        emb = x.new_zeros(*shape, self.config.ple_embed_dim)
        emb[real.to(x.device)] = rows
        return emb

    def forward(self, tokens: torch.Tensor, cache: ModelCache, n_new: torch.Tensor | None = None,
                tap: Tap = no_tap, last_only: bool = False, hidden: bool = False):
        """tokens (B, T), right-padded when rows differ (`n_new` real tokens each).

        With `hidden`, returns (logits, h): h (B, T, hidden) is every position's streams collapsed
        by the output mixer (what the LM head reads; the MTP head's input), whatever `last_only`
        says of the logits."""
        c = self.config
        step = cache.step(tokens.shape[1], n_new)
        pending = self._start_ple(tokens, cache, step) if self.ple_layer is not None else None
        x = F.embedding(tokens, self.tok_embd).repeat(1, 1, c.hc_count)  # (B, T, hc * hidden)
        rope_cs = self.rope.cos_sin(step.positions)
        experts, place = self.seams.experts, self.seams.placement
        for i, (block, layer_cache) in enumerate(zip(self.blocks, cache.layers)):
            experts.begin_block(i, x, step)
            emb = None
            if i == self.ple_layer:
                emb = self._ple_rows(pending, x, tokens.shape, step)
            x, block_step, block_cs = place.block_inputs(i, x, step, rope_cs)  # on the block's device
            x = block(x, layer_cache, block_step, block_cs, _prefixed(tap, i), emb)
            tap(f"l_out-{i}", x)
        x = place.head_input(x)
        cache.advance(step)
        if hidden:
            h = self.output_mixer(x)
            last = step.last_real(h) if last_only else h
            return F.linear(last, self.output), h
        if last_only:
            x = step.last_real(x)
        x = self.output_mixer(x)
        return F.linear(x, self.output)
