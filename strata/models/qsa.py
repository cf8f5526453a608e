"""QSA: gated attention whose keys are pruned, per query, to a budget of whole blocks.

The indexer (one key head, `n_idx` query heads of width `d_idx`) splits each row's keys into
blocks of `ratio` consecutive tokens. A query at position p sees (p+1) // ratio complete blocks
and an incomplete tail. Each complete block j is scored by one key: the mean of its raw indexer
keys, RMS-normed (`indexer.k_norm`) and roped at the block's first position j*ratio; the score
is sum over query heads of relu(q_h . k_j) / sqrt(d_idx), with q RMS-normed and roped at p.
The query attends to the `budget // ratio` best complete blocks plus the whole tail (so never
more than budget + ratio - 1 keys), intersected with the causal mask. While a query has no more
complete blocks than that, it attends to everything: short contexts are exactly dense, and a
step where no query exceeds the budget skips the indexer's selection altogether.

Ties (blocks that score exactly 0 for every head) are broken as transformers breaks them: the
top-k runs over each query's own score vector of length `complete blocks`, grouped so queries
with the same count share one call (CPU top-k treats each row alone, so the choice is the same).

The cache keeps, beside keys and values, each row's raw indexer keys (pooling comes before the
norm and the rope, so raw keys are what a later block needs); block keys are rebuilt from them
each step, which costs one pass over S * d_idx values, far below the attention itself.

Weights (llama.cpp's names): attn_q ([q | gate] per head), attn_k, attn_v, attn_output,
attn_q_norm, attn_k_norm, indexer.q_proj, indexer.k_proj, indexer.q_norm, indexer.k_norm (the
norms zero-centred in HF and stored as 1 + w; HF's fused `index_qk_proj` is split in q then k).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from strata.kernels.gpu.graphs import boundary
from strata.models.cache import KVCache, StepInfo, _pad_seq
from strata.models.layers import Attention, RMSNorm, Tap, no_tap
from strata.models.rope import Rope
from strata.models.weights import WeightLoader


class IndexKeys:
    """Mixin for a KV cache that also keeps each row's raw indexer keys `(B, capacity, d_idx)`
    (small beside the KV, kept whole); shared by `QSACache` and the tiered KV cache."""

    ik: torch.Tensor | None = None

    def update_index_keys(self, k: torch.Tensor, step: StepInfo) -> torch.Tensor:
        """Write this step's (B, T, d) raw indexer keys at each row's offset; return (B, S, d)."""
        b, t, d = k.shape
        end = step.end
        cap = 0 if self.ik is None else self.ik.shape[1]
        if end > cap:
            grown = k.new_zeros(b, max(end, 2 * cap, 16), d)
            if self.ik is not None:
                grown[:, :cap] = self.ik
            self.ik = grown
        idx = step.positions.to(k.device)[..., None].expand(b, t, d)
        self.ik.scatter_(1, idx, k)
        return self.ik[:, :end]

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        if self.ik is not None:
            self.ik = self.ik[rows]

    def extend(self, other) -> None:
        mine = self.ik
        super().extend(other)
        if other.ik is not None:  # None: `other` has run no forward, so it holds no rows
            self.ik = concat_rows(mine, other.ik)

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.ik is None else self.ik.nbytes)


class QSACache(IndexKeys, KVCache):
    """Keys and values (as `KVCache`) plus each row's raw indexer keys."""


def concat_rows(mine: torch.Tensor | None, theirs: torch.Tensor) -> torch.Tensor:
    """Indexer keys `(B, S, D)` of two batches as one, the shorter zero-padded along S."""
    if mine is None:
        return theirs
    cap = max(mine.shape[1], theirs.shape[1])
    return torch.cat([_pad_seq(mine[:, None], cap)[:, 0], _pad_seq(theirs[:, None], cap)[:, 0]])


class QSAIndexer(nn.Module):
    def __init__(self, w: WeightLoader, prefix: str, hidden: int, n_heads: int, dim: int, budget: int,
                 ratio: int, rope: Rope, eps: float):
        super().__init__()
        if budget % ratio:
            raise ValueError(f"the indexer budget {budget} is not a multiple of its block size {ratio}")
        self.n_heads, self.dim, self.ratio = n_heads, dim, ratio
        self.top_blocks = budget // ratio
        self.wq = w.linear(f"{prefix}.indexer.q_proj.weight", (n_heads * dim, hidden))
        self.wk = w.linear(f"{prefix}.indexer.k_proj.weight", (dim, hidden))
        self.q_norm = RMSNorm(w.dense(f"{prefix}.indexer.q_norm.weight", (dim,)), eps)
        self.k_norm = RMSNorm(w.dense(f"{prefix}.indexer.k_norm.weight", (dim,)), eps)
        self.rope = rope

    @boundary  # scores over a key set that grows every step: eager in compiled decode steps
    def forward(self, x: torch.Tensor, cache: QSACache, step: StepInfo, rope_cs) -> torch.Tensor | None:
        """(B, 1, T, S) keys each query may attend to (before the causal mask), or None for all."""
        b, t, _ = x.shape
        keys = cache.update_index_keys(self.wk(x), step)  # raw: (B, S, d)
        host = step.on(torch.device("cpu"))  # which blocks exist is host bookkeeping: decided without a read
        complete_host = (host.positions + 1) // self.ratio  # (B, T) complete blocks each query sees
        if not bool((complete_host > self.top_blocks).any()):
            return None  # within budget everywhere: dense
        complete = complete_host.to(x.device, non_blocking=True)
        q = self.q_norm(self.wq(x).view(b, t, self.n_heads, self.dim))
        q = self.rope.apply(q, *rope_cs)
        n_blocks = int(complete_host.max())
        r = self.ratio
        pooled = keys[:, :n_blocks * r].reshape(b, n_blocks, r, self.dim).float().mean(2).to(keys.dtype)
        block_pos = (torch.arange(n_blocks) * r)[None].expand(b, -1)  # where the rope's tables live
        cos, sin = self.rope.cos_sin(block_pos)
        block_keys = self.rope.apply(self.k_norm(pooled)[:, :, None], cos.to(x.device, non_blocking=True),
                                     sin.to(x.device, non_blocking=True))[:, :, 0]
        scores = torch.einsum("bthd,bnd->btnh", q.float(), block_keys.float())
        scores = scores.relu().sum(-1) / math.sqrt(self.dim)  # (B, T, n_blocks)
        chosen = torch.arange(n_blocks, device=x.device) < complete[..., None]  # all complete blocks
        k = self.top_blocks
        for row in range(b):
            counts = complete_host[row]
            for n in torch.unique(counts[counts > k]).tolist():
                queries = (counts == n).nonzero().flatten().to(x.device, non_blocking=True)
                top = scores[row, queries, :n].topk(k, dim=-1).indices
                picked = torch.zeros(len(queries), n_blocks, dtype=torch.bool, device=x.device)
                chosen[row, queries] = picked.scatter_(1, top, True)
        n_keys = keys.shape[1]
        key_block = torch.arange(n_keys, device=x.device) // r
        in_tail = key_block[None, None] >= complete[..., None]  # (B, T, S): past the last complete block
        in_chosen = chosen.gather(2, key_block.clamp(max=n_blocks - 1)[None, None].expand(b, t, -1))
        return (in_tail | in_chosen)[:, None]


class QSAAttention(Attention):
    """Gated attention (q/k norms, partial rope, sigmoid output gate) restricted by a `QSAIndexer`;
    without an indexer (a file with none) it is plain gated attention."""

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, n_heads: int, n_kv: int, head_dim: int,
                 rope: Rope, eps: float, indexer: QSAIndexer | None):
        super().__init__(w, prefix, hidden, n_heads, n_kv, head_dim, rope, eps, qk_norm=True, gated=True)
        self.indexer = indexer

    def new_cache(self, kv_cache=None) -> QSACache:
        """A `QSACache`, or what the model's KV-cache factory makes (tiered: the most selected blocks
        stay resident)."""
        return kv_cache(self) if kv_cache is not None else QSACache()

    def forward(self, x, cache: QSACache, step: StepInfo, rope_cs, tap: Tap = no_tap):
        b, t, _ = x.shape
        q, gate = self.wq(x).view(b, t, self.n_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        gate = gate.reshape(b, t, self.n_heads * self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope.apply(q, *rope_cs), self.rope.apply(k, *rope_cs)
        tap("Qcur", q)
        tap("Kcur", k)
        chosen = self.indexer(x, cache, step, rope_cs) if self.indexer is not None else None  # (B, 1, T, S)
        out = cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), step, chosen)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim) * torch.sigmoid(gate)
        tap("kqv_out", out)
        return self.wo(out)
