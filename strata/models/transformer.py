"""The decoder-only skeleton most architectures share: embed, blocks, norm, output.

Architecture files build their blocks and hand them to `DecoderLM`; the forward loop,
cache bookkeeping and padding rules live here once.
"""

from __future__ import annotations

import operator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from strata import kernels
from strata.kernels import decode_ops, decode_stack
from strata.formats.weights import QTensor
from strata.kernels.threads import one_thread_if_small
from strata.models.cache import KVCache, ModelCache, StepInfo
from strata.models.gated_deltanet import GatedDeltaNet, GDNCache
from strata.models.layers import (Attention, DenseFFN, Experts, RMSNorm, ResidentExperts, SharedExpert, Tap, no_tap,
                                  softmax_topk)
from strata.models.linear import Embedding, Linear
from strata.models.rope import Rope
from strata.models.seams import InPlace, Resident, Seams
from strata.models.weights import WeightLoader


class MoE(nn.Module):
    """Route each real token to its experts; padded positions are never routed."""

    def __init__(self, router: torch.Tensor, experts: nn.Module, route, shared: nn.Module | None = None):
        super().__init__()
        self.router = router  # (E, hidden)
        self.experts = experts
        self.route = route  # logits -> (ids, weights), the architecture's rule
        self.shared = shared  # an always-on expert added to the routed sum (e.g. `SharedExpert`)
        self.c_route = _c_route(self)  # once: what a decode token's one C call needs (None: it does not apply)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None, tap: Tap = no_tap) -> torch.Tensor:
        """`token_mask` None: every position is real (decode), so no boolean index (a device
        read, as its size depends on the data) is needed."""
        if token_mask is None:
            flat = x.reshape(-1, x.shape[-1])
        else:
            flat = x[token_mask]  # (N, hidden): real tokens only
        with one_thread_if_small(flat.numel() * self.router.shape[0], flat.device):
            logits = F.linear(flat.float(), self.router.float())  # fp32, as llama.cpp: bf16 flips near-ties
        ids, weights = self.route(logits)
        weights = weights.to(flat.dtype)
        tap("ffn_moe_topk", ids)
        if self.shared is not None and flat.device.type == "cpu" and getattr(self.experts, "overlaps", False):
            # the tiers compute the shared expert while the routed ones are read and computed
            # (summed in the same order as below)
            shared = []
            routed = self.experts(flat, ids, weights, beside=lambda: shared.append(self.shared(flat)))
            routed = routed + shared[0]
        else:
            routed = self.experts(flat, ids, weights)
            if self.shared is not None:
                routed = routed + self.shared(flat)
        if token_mask is None:
            return routed.reshape(x.shape)
        out = torch.zeros_like(x)
        out[token_mask] = routed
        return out


def _c_route(moe: MoE) -> tuple[int, bool] | None:
    """The router's (k, normalize) where a decode token's MoE half can run in one C call
    (`decode_ops.try_moe_block`: resident experts, a `SharedExpert` or none, and the plain softmax
    top-k router `partial(softmax_topk, k=, normalize=)`), else None."""
    r = moe.route
    ok = ((moe.shared is None or type(moe.shared) is SharedExpert) and isinstance(r, partial) and r.func is softmax_topk
          and not r.args and set(r.keywords) == {"k", "normalize"} and type(moe.experts) is Experts
          and type(moe.experts.backend) is ResidentExperts)
    return (r.keywords["k"], r.keywords["normalize"]) if ok else None


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, attn_norm: RMSNorm, attn: Attention, ffn_norm: RMSNorm, ffn: nn.Module):
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn

    @classmethod
    def from_weights(cls, w: WeightLoader, prefix: str, hidden: int, eps: float, attn, ffn) -> "Block":
        """The block with llama.cpp's `attn_norm` / `ffn_norm` around `attn` and `ffn`."""
        return cls(RMSNorm(w.dense(f"{prefix}.attn_norm.weight", (hidden,)), eps), attn,
                   RMSNorm(w.dense(f"{prefix}.ffn_norm.weight", (hidden,)), eps), ffn)

    def forward(self, x, cache: KVCache, step: StepInfo, rope_cs, tap: Tap) -> torch.Tensor:
        h = None
        if tap is no_tap and type(self.attn_norm) is RMSNorm:  # a decode token: one C call
            if type(self.attn) is Attention and type(cache) is KVCache:
                h = decode_ops.try_attention_block(x, self.attn_norm, self.attn, cache, step, rope_cs)
            elif type(self.attn) is GatedDeltaNet and type(cache) is GDNCache:
                h = decode_ops.try_gdn_block(x, self.attn_norm, self.attn, cache, step)
        if h is None:
            h = x + self.attn(self.attn_norm(x), cache, step, rope_cs, tap)
        tap("ffn_inp", h)
        # the MoE's token mask is read in this frame: in a compiled step a host read here splits the
        # graph at a jump, where inside `ffn_half` it is an `item()` break (tests/test_cuda_graphs.py)
        mask = None if not isinstance(self.ffn, MoE) or step.all_real else step.token_mask
        return self.ffn_half(h, step, tap, mask)

    def ffn_half(self, h, step: StepInfo, tap: Tap, moe_mask=False) -> torch.Tensor:
        """h + ffn(norm(h)), the block's second half; `moe_mask` as `forward` reads it (False: not read)."""
        if tap is no_tap and type(self.ffn_norm) is RMSNorm and h.dtype is torch.float32 and h.device.type == "cpu":
            y = None  # (checked first: a compiled GPU / bf16 step reads no host scalar here)
            if type(self.ffn) is DenseFFN:
                y = decode_ops.try_ffn_block(h, self.ffn_norm, self.ffn)
            elif type(self.ffn) is MoE and self.ffn.c_route is not None and int(step.n_new[0]) == 1:
                y = decode_ops.try_moe_block(h, self.ffn_norm, self.ffn, *self.ffn.c_route)
            if y is not None:
                return y
        normed = self.ffn_norm(h)
        if isinstance(self.ffn, MoE):
            if moe_mask is False:
                moe_mask = None if step.all_real else step.token_mask
            out = self.ffn(normed, moe_mask, tap)
            tap("ffn_moe_out", out)
        else:
            out = self.ffn(normed)
        return h + out

    def new_cache(self, kv_cache=None):
        """The mixer's cache: keys/values (from the model's KV-cache factory, if any) or a recurrent state."""
        return self.attn.new_cache(kv_cache)


class DecoderLM(nn.Module):
    """Token embedding, a stack of blocks, final norm and output projection."""

    def __init__(self, config, w: WeightLoader, blocks: list[nn.Module], rope: Rope, eps: float, seams: Seams):
        """`seams`: what the blocks' experts were built with, and the KV-cache factory and placement
        the forward loop uses (`strata.models.seams`)."""
        super().__init__()
        c = config
        self.config = c
        self.seams = seams
        self.tok_embd = w.embedding("token_embd.weight", (c.vocab_size, c.hidden_size))
        self.blocks = nn.ModuleList(blocks)
        self.output_norm = RMSNorm(w.dense("output_norm.weight", (c.hidden_size,)), eps)
        if w.has("output.weight"):
            self.output = w.linear("output.weight", (c.vocab_size, c.hidden_size))
        else:  # tied embeddings: the same table, blocks or floats
            self.output = Linear(self.tok_embd.weight)
        self.rope = rope
        self._c_stack: decode_stack.Stack | None = None  # a decode token's layers in one C call
        # ... and its embedding, final norm and head: (what they were built from, the Ends or None
        # where the head was declined), compared by identity each step
        self._c_ends: tuple[tuple, decode_stack.Ends | None] | None = None
        self._c_rope = None  # (rope, cos rows, sin rows, rows filled): the one-call token's rotations

    def _decode_layers(self):
        """Each block's (attn_norm, mixer, ffn_norm, ffn, route) for decode_stack, or None where a
        block is not an attention or Gated DeltaNet + dense/MoE one (route: None for a dense FFN,
        else the router's (k, normalize) of a one-C-call MoE)."""
        layers = []
        for b in self.blocks:
            if type(b) is not Block or type(b.attn_norm) is not RMSNorm or type(b.ffn_norm) is not RMSNorm \
                    or type(b.attn) not in (Attention, GatedDeltaNet):
                return None
            ffn = b.ffn
            if type(ffn) is DenseFFN:
                route = None
            elif type(ffn) is MoE and ffn.c_route is not None:
                route = ffn.c_route
            else:
                return None
            layers.append((b.attn_norm, b.attn, b.ffn_norm, ffn, route))
        return layers

    def _token_decode(self, tokens: torch.Tensor, ends: decode_stack.Ends, cache: ModelCache):
        """One decode token's logits (1, 1, vocab) through the embedding, every block and the head in
        one C call (decode_stack.try_decode with the token), the cache advanced; a Partial (the cache
        not advanced: the blocks run the rest); or None where it does not apply (nothing ran). The
        Python around the call is kept to a few operations: it runs on caches the kernels have just
        flushed (a qwen3-30b token at 2 threads spent ~2 ms of wall time in it). The caller checked
        the seams and caches (`_seams_ok`, `_caches_ok`)."""
        lengths = cache.lengths
        if not ends.embd_ptr or lengths.numel() != 1:
            return None
        pos = int(lengths.item())
        rows = self._rope_rows(pos)
        stack = self._current_stack(ends.hidden, rows[0].shape[1])
        if stack is None:
            return None
        y = decode_stack.try_decode(stack, None, cache.layers, pos, rows, (ends, int(tokens.item())))
        if type(y) is torch.Tensor:
            cache.lengths = lengths + 1  # (ModelCache.advance of a one-token step)
        return y

    def _rope_rows(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables (rows, rot / 2) of the rope's values at positions 0 .. >= pos, each row
        what `rope.cos_sin` gives that position alone (so the one-call token and the blocks rotate
        by the same values), filled ROPE_ROWS positions at a time and kept while the rope is."""
        t = self._c_rope
        if t is None or t[0] is not self.rope or pos >= t[3]:
            t = self._fill_rope(pos)
        return t[1], t[2]

    def _fill_rope(self, pos: int):
        rope, t = self.rope, self._c_rope
        if t is None or t[0] is not rope:
            t = (rope, torch.empty(0, 0), torch.empty(0, 0), 0)
        _, cos, sin, filled = t
        want = max(pos + 1, filled + ROPE_ROWS)
        if want > cos.shape[0]:
            half = rope.inv_freq.numel()
            grown = [torch.empty(max(want, 2 * cos.shape[0]), half) for _ in range(2)]
            if filled:
                grown[0][:filled], grown[1][:filled] = cos[:filled], sin[:filled]
            cos, sin = grown
        for p in range(filled, want):
            c, s = rope.cos_sin(torch.tensor([[p]]))
            cos[p], sin[p] = c.reshape(-1), s.reshape(-1)
        self._c_rope = t = (rope, cos, sin, want)
        return t

    def _seams_ok(self) -> bool:
        """Whether a decode token's ends may run in C (`_ends`): kernels on, resident experts in place."""
        return kernels.USE_KERNELS and type(self.seams.experts) is Resident and type(self.seams.placement) is InPlace

    @staticmethod
    def _caches_ok(cache: ModelCache) -> bool:
        """... and its layers in one call: every layer's cache a KVCache or GDNCache. Both are checked
        once a step, in `forward`."""
        return all(type(c) is KVCache or type(c) is GDNCache for c in cache.layers)

    def _current_stack(self, hidden: int, rot_half: int) -> decode_stack.Stack | None:
        """The one-call Stack of the blocks as they are now (built or rebuilt here), or None where
        it does not apply (declined until a block or the mode changes)."""
        stack = self._c_stack
        if stack is not None and stack.layers is None:  # declined: until a block or the mode changes
            if decode_stack.current(stack, self._block_kinds(), hidden, rot_half):
                return None
        elif stack is not None and decode_stack.current(stack, decode_stack.sources(self.blocks), hidden, rot_half):
            return stack
        layers = self._decode_layers()
        stack = decode_stack.build(decode_stack.sources(self.blocks), layers, hidden, rot_half) if layers else None
        if stack is None or stack.layers is None:
            stack = decode_stack.Stack(self._block_kinds(), None, [], hidden, rot_half)
        self._c_stack = stack
        return stack if stack.layers is not None else None

    def _stack_decode(self, x, cache: ModelCache, step: StepInfo, rope_cs) -> torch.Tensor | None:
        """x after every block for one decode token of one row in one C call (decode_stack), or None
        where it does not apply: the caller runs the blocks one by one (the caller checked the seams
        and caches, `_seams_ok`, `_caches_ok`)."""
        if (x.dtype is not torch.float32 or x.device.type != "cpu" or step.start.numel() != 1
                or int(step.n_new[0]) != 1):
            return None
        stack = self._current_stack(x.shape[-1], rope_cs[0].numel())
        return None if stack is None else decode_stack.try_decode(stack, x, cache.layers, int(step.start[0]), rope_cs)

    def _ends(self) -> decode_stack.Ends | None:
        """The embedding, final norm and head of a decode token in C (decode_stack.Ends), rebuilt
        when one of them or the activation mode changes; None where they do not apply (a norm or
        head of another kind; the caller checked the seams, `_seams_ok`)."""
        norm, head, embd = self.output_norm, self.output, self.tok_embd
        src = (kernels.activations(), norm, norm._parameters.get("weight"), head, head.weight, head.bias, embd,
               embd.weight)
        known = self._c_ends
        if known is not None and all(map(operator.is_, known[0], src)):
            return known[1]
        ew = embd.weight if type(embd) is Embedding and embd.dtype is torch.float32 else None
        ok = (type(norm) is RMSNorm and type(head) is Linear and head.bias is None and isinstance(head.weight, QTensor)
              and src[2] is not None)
        e = decode_stack.ends(src[2], norm.eps, head.weight, ew if isinstance(ew, QTensor) else None,
                              self.config.hidden_size) if ok else None
        self._c_ends = (src, e)
        return e

    def _block_kinds(self) -> list:
        """The blocks and their parts (a declined stack is tried again when one of these changes)."""
        return [kernels.activations(), *(m for b in self.blocks for m in (b, *b._modules.values()))]

    def new_cache(self, batch: int = 1) -> ModelCache:
        return ModelCache([b.new_cache(self.seams.kv_cache) for b in self.blocks], batch)

    def forward(self, tokens: torch.Tensor, cache: ModelCache, n_new: torch.Tensor | None = None,
                tap: Tap = no_tap, last_only: bool = False, hidden: bool = False):
        """tokens (B, T), right-padded when rows differ (`n_new` real tokens each).

        With `hidden`, returns (logits, h): h (B, T, hidden) is every position's last hidden
        state after the final norm (what the output head reads; an MTP draft head's input),
        whatever `last_only` says of the logits."""
        # a decode token on the CPU: its head in C, its layers too where its caches are the stack's
        c = tap is no_tap and tokens.shape == (1, 1) and tokens.device.type == "cpu" and self._seams_ok()
        ends = self._ends() if c and not hidden else None
        one = c and self._caches_ok(cache)
        y = None
        if ends is not None and n_new is None and one:  # ... with its embedding and head, and little Python
            y = self._token_decode(tokens, ends, cache)
            if type(y) is torch.Tensor:
                return y
        step = cache.step(tokens.shape[1], n_new)
        rope_cs = self.rope.cos_sin(step.positions)
        experts, place = self.seams.experts, self.seams.placement
        if y is None:
            x = self.tok_embd(tokens)  # (B, T, hidden)
            y = self._stack_decode(x, cache, step, rope_cs) if one else None
        first = 0  # the first block the loop below runs
        if type(y) is decode_stack.Partial:  # a layer half found no memory: the blocks from there on
            x, first = y.x, y.layer
            if y.h is not None:  # its mixer half ran
                x, first = self.blocks[first].ffn_half(y.h, step, tap), first + 1
        elif y is not None:
            x, first = y, len(self.blocks)
        for i in range(first, len(self.blocks)):
            block = self.blocks[i]
            experts.begin_block(i, x, step)
            x, block_step, block_cs = place.block_inputs(i, x, step, rope_cs)  # on the block's device
            x = block(x, cache.layers[i], block_step, block_cs, _prefixed(tap, i))
            tap(f"l_out-{i}", x)
        x = place.head_input(x)
        cache.advance(step)
        if hidden:
            h = self.output_norm(x)
            last = step.last_real(h) if last_only else h
            return self.output(last), h
        if last_only:  # decode and sampling need only each row's last real position
            x = step.last_real(x)
        if ends is not None:  # the head the one-call token takes (the same logits, whichever ran)
            y = decode_stack.try_head(ends, x)
            if y is not None:
                return y
        x = self.output_norm(x)
        return self.output(x)


ROPE_ROWS = 64  # positions of rotary values the one-call token path computes at a time


def _prefixed(tap: Tap, layer: int) -> Tap:
    if tap is no_tap:
        return tap
    return lambda name, t: tap(f"{name}-{layer}", t)
