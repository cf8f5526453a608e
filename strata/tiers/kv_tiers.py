"""Tiered KV cache for long contexts: a bounded pool of KV blocks on the device, the rest in host RAM.

Every row's keys and values live in host memory (pinned on CUDA), written through on each
step; that copy is the authority. The device holds at most `budget // block_bytes` blocks of
`block` tokens (one row, all KV heads) in a fixed pool `(H, slots, block, D)`, split into
resident slots and staging slots. Each row's block table (block -> slot) and selection counts
are tensors: residency is one top-k, the blocks it brings in are loaded by one gather, and a
step's write reaches a resident block's slot directly.

Attention is merged by log-sum-exp (the online softmax flash attention uses; on CPU torch's
flash kernel, which returns the log-sum-exp, elsewhere a plain fp32 softmax), in one of two ways:

* few queries (decode, a verify pass over drafts: at most `FEW_QUERIES` per row): two parts,
  one call over the resident slots of the pool (masked to this row's keys) and one call, by the
  host, over the span of host memory that holds the other needed blocks (masked only where
  resident or unselected blocks lie inside it). On CUDA that second part runs on the CPU: a
  decode step's queries are tiny, the keys they read are not, and the host reads its own memory
  faster than PCIe could move it. Two kernel calls per row and layer at any context length.
* many queries (prefill chunks): block by block, a resident block read in place from the pool,
  any other copied from host memory into a staging slot (CUDA: from pinned memory on a side
  stream, the next block's copy overlapping the current block's math; CPU, where a slice of RAM
  stands in for the device: a real copy into the separate pool, by the same code), so no (T, S)
  score matrix or mask is built.

Which blocks are resident: for dense attention (every block read every step) the first
("sink") block and the most recent ones; for QSA layers (the indexer picks blocks) the blocks
selected most often, counting per block the queries that selected it, the least selected
evicted. Blocks a QSA step does not select are not read at all.

`device_bytes` is the pool's size, never more than the layer's budget. The output equals the
untiered `KVCache` path up to floating-point reassociation. Not tiered: a QSA layer's indexer keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.errors import BadOption, StrataError
from strata.kernels.gpu.graphs import boundary
from strata.models.cache import StepInfo
from strata.models.layers import Attention
from strata.models.qsa import IndexKeys, QSAAttention
from strata.tiers.sizes import format_size, parse_size

DEFAULT_BLOCK = 256
FEW_QUERIES = 16  # a step with at most this many queries per row attends in two parts
_NOWHERE = 2**62  # key position of a pool entry a row does not hold: after every query, so masked


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """One attention layer's share: `budget` device bytes for KV blocks of `block` tokens."""

    budget: int
    block: int = DEFAULT_BLOCK
    sink_blocks: int = 1


def block_bytes(n_kv: int, head_dim: int, block: int, dtype: torch.dtype) -> int:
    """Device bytes of one block of one row: keys and values of every KV head."""
    return 2 * n_kv * block * head_dim * torch.empty((), dtype=dtype).element_size()


def layer_configs(text, attn_layers: list, dtype: torch.dtype, block: int = DEFAULT_BLOCK,
                  flag: str = "--kv-device") -> KVTierConfig:
    """Parse `--kv-device SIZE` and split it evenly over `attn_layers`; a clear `BadOption` when it
    cannot hold one block per layer."""
    total = parse_size(text, flag)
    if not attn_layers:
        raise BadOption(f"{flag} given, but the model has no attention layer to tier")
    per_layer = total // len(attn_layers)
    need = max(block_bytes(a.n_kv, a.head_dim, block, dtype) for a in attn_layers)
    if per_layer < need:
        raise BadOption(f"{flag} {text!r} is smaller than one KV block per attention layer "
                        f"({len(attn_layers)} layers x {format_size(need)} for {block} tokens)",
                        f"give at least {flag} {math.ceil(need * len(attn_layers) / 2**20)}M")
    return KVTierConfig(per_layer, block)


class _Row:
    """One sequence: its host copy `(H, capacity, D)` (capacity a whole number of blocks), the pool
    slot of each block and the queries that selected each block."""

    __slots__ = ("count", "k", "n", "pool_pos", "slot_of", "v")

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slot_of = torch.zeros(0, dtype=torch.long)  # block -> pool slot, -1: in host memory only
        self.count = torch.zeros(0, dtype=torch.long)  # block -> queries that selected it (QSA)
        self.n = 0  # keys written (this row's length after the last step)
        # (resident slots * block,) on the device: the key position each pool entry holds for this
        # row, _NOWHERE where the entry is another row's or empty; None until a block is resident
        self.pool_pos: torch.Tensor | None = None

    @property
    def resident(self) -> dict[int, int]:
        """block -> pool slot, for the resident blocks."""
        held = (self.slot_of >= 0).nonzero().flatten()
        return dict(zip(held.tolist(), self.slot_of[held].tolist()))

    @property
    def counts(self) -> dict[int, int]:
        """block -> queries that selected it, for the blocks selected at least once."""
        picked = self.count.nonzero().flatten()
        return dict(zip(picked.tolist(), self.count[picked].tolist()))


class TieredKVCache:
    """A `KVCache` stand-in whose device part is bounded; see the module docstring.

    The attention layer calls `attend` (not `update_and_fetch`); `update_and_fetch` still works
    (it returns all keys, gathered from host memory) for code that wants the full tensors.
    """

    def __init__(self, config: KVTierConfig, frequency: bool = False):
        self.config = config
        self.block = config.block
        self.frequency = frequency  # evict the least selected (QSA) rather than the oldest
        self.rows: list[_Row] = []
        self.pool_k: torch.Tensor | None = None  # (H, slots, block, D) on the device
        self.pool_v: torch.Tensor | None = None
        self.owner: list[tuple[_Row, int] | None] = []  # resident slot -> (row, block)
        self.n_resident = 0
        self.staging: list[int] = []
        self.copies = 0  # blocks copied host -> device (resident loads and staged reads)
        self._used = 0  # resident slots up to the last one in use: what the two-part path reads
        self._dirty = True  # residency must be recomputed (block counts or rows changed)
        self._stream = None

    # ---- storage -------------------------------------------------------------------------------
    def _setup(self, b: int, k: torch.Tensor) -> None:
        _, h, _, d = k.shape
        if not self.rows:
            self.rows = [_Row() for _ in range(b)]
        if self.pool_k is None:
            per_slot = block_bytes(h, d, self.block, k.dtype) // 2
            slots = self.config.budget // (2 * per_slot)
            if slots < 1:
                raise BadOption(f"--kv-device leaves {self.config.budget} bytes for this layer, less than one "
                                f"KV block ({2 * per_slot} bytes)", "raise --kv-device")
            self.pool_k = k.new_zeros(h, slots, self.block, d)
            self.pool_v = k.new_zeros(h, slots, self.block, d)
            n_stage = 1 if slots == 1 else 2
            self.n_resident = slots - n_stage
            self.staging = list(range(self.n_resident, slots))
            self.owner = [None] * self.n_resident
            if k.is_cuda:
                self._stream = torch.cuda.Stream(device=k.device)

    def _n_blocks(self, row: _Row) -> int:
        return -(-row.n // self.block)

    def _reserve(self, row: _Row, end: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Grow the row's host copy (by doubling, to whole blocks) and its block tables to `end` keys."""
        cap = 0 if row.k is None else row.k.shape[1]
        if end <= cap:
            return
        blk = self.block
        new_cap = -(-max(end, 2 * cap, blk) // blk) * blk
        pin = k.is_cuda
        nk = torch.zeros(k.shape[0], new_cap, k.shape[2], dtype=k.dtype, pin_memory=pin)
        nv = torch.zeros(v.shape[0], new_cap, v.shape[2], dtype=v.dtype, pin_memory=pin)
        if row.k is not None:
            nk[:, :cap] = row.k
            nv[:, :cap] = row.v
        row.k, row.v = nk, nv
        grow = new_cap // blk - len(row.slot_of)
        row.slot_of = torch.cat([row.slot_of, row.slot_of.new_full((grow,), -1)])
        row.count = torch.cat([row.count, row.count.new_zeros(grow)])

    def _write(self, row: _Row, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write `(H, n, D)` at `start` in the row's host copy, and through to the pool slots of the
        resident blocks it touches."""
        end = start + k.shape[1]
        self._reserve(row, end, k, v)
        row.k[:, start:end] = k.to("cpu")
        row.v[:, start:end] = v.to("cpu")
        blk = self.block
        first = start // blk
        for j, slot in enumerate(row.slot_of[first:(end - 1) // blk + 1].tolist(), first):
            if slot >= 0:
                lo, hi = max(start, j * blk), min(end, (j + 1) * blk)
                self.pool_k[:, slot, lo - j * blk:hi - j * blk] = k[:, lo - start:hi - start]
                self.pool_v[:, slot, lo - j * blk:hi - j * blk] = v[:, lo - start:hi - start]

    def _load(self, row: _Row, blocks: list[int], slots: list[int], wait: bool) -> None:
        """Copy `blocks` of `row` from host memory into pool `slots`, all in one gather."""
        self.copies += len(blocks)
        h, _, d = row.k.shape
        if self._stream is None:
            dst = torch.tensor(slots, device=self.pool_k.device)
            self.pool_k.index_copy_(1, dst, row.k.view(h, -1, self.block, d)[:, blocks])
            self.pool_v.index_copy_(1, dst, row.v.view(h, -1, self.block, d)[:, blocks])
            return
        device = self.pool_k.device
        which = torch.tensor(blocks)
        self._stream.wait_stream(torch.cuda.current_stream(device))  # the slots are free to overwrite
        with torch.cuda.stream(self._stream):  # everything the copy allocates belongs to the copy stream
            dst = torch.tensor(slots).pin_memory().to(device, non_blocking=True)
            for pool, src in ((self.pool_k, row.k), (self.pool_v, row.v)):
                view = src.view(h, -1, self.block, src.shape[-1])
                staged = torch.empty((h, len(blocks), self.block, src.shape[-1]), dtype=src.dtype, pin_memory=True)
                torch.index_select(view, 1, which, out=staged)  # gathered straight into pinned memory, once
                pool.index_copy_(1, dst, staged.to(device, non_blocking=True))
        if wait:
            torch.cuda.current_stream(device).wait_stream(self._stream)

    def _ready(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.pool_k.device).wait_stream(self._stream)

    # ---- residency -----------------------------------------------------------------------------
    def _priority(self, row: _Row) -> torch.Tensor:
        """One number per block of the row, higher = keep on the device."""
        j = torch.arange(self._n_blocks(row))
        if self.frequency:
            return row.count[:len(j)] * 2**32 + j  # the most selected, ties to the latest
        return j + (j < self.config.sink_blocks) * 2**32  # the sink block, then the most recent

    def _rebalance(self) -> None:
        """Make the `n_resident` best (row, block) pairs resident: one top-k over every row's blocks,
        then per row one gather for the blocks that come in."""
        self._dirty = False
        if self.n_resident == 0:
            return
        rows = list({id(r): r for r in self.rows}.values())  # a row kept twice counts once
        prio = torch.cat([self._priority(row) for row in rows])
        want = torch.zeros(len(prio), dtype=torch.bool)
        want[prio.topk(min(self.n_resident, len(prio))).indices] = True
        arrivals, at = [], 0
        for row in rows:
            nb = self._n_blocks(row)
            wanted = torch.zeros(len(row.slot_of), dtype=torch.bool)
            wanted[:nb] = want[at:at + nb]
            at += nb
            held = row.slot_of >= 0
            gone = (held & ~wanted).nonzero().flatten()
            for slot in row.slot_of[gone].tolist():
                self.owner[slot] = None
            row.slot_of[gone] = -1
            arrivals.append((row, (wanted & ~held).nonzero().flatten().tolist(), len(gone) > 0))
        free = [s for s, own in enumerate(self.owner) if own is None]
        for row, new, evicted in arrivals:
            if new:
                slots, free = free[:len(new)], free[len(new):]
                self._load(row, new, slots, wait=False)
                row.slot_of[new] = torch.tensor(slots)
                for j, s in zip(new, slots):
                    self.owner[s] = (row, j)
            if new or evicted:
                self._map_pool(row)
        self._ready()
        self._used = max((s + 1 for s, own in enumerate(self.owner) if own is not None), default=0)

    def _map_pool(self, row: _Row) -> None:
        """Record which key position each resident pool entry holds for `row` (`row.pool_pos`)."""
        blk = self.block
        pos = torch.full((self.n_resident, blk), _NOWHERE, dtype=torch.long)
        held = (row.slot_of >= 0).nonzero().flatten()
        pos[row.slot_of[held]] = held[:, None] * blk + torch.arange(blk)
        row.pool_pos = pos.view(-1).to(self.pool_k.device)

    # ---- attention -----------------------------------------------------------------------------
    @boundary  # host bookkeeping of resident blocks: eager between compiled segments
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInfo,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's `(B, H, T, D)` keys/values, then attend `q` `(B, Hq, T, D)` to each row's
        keys (causal, and where `allowed` `(B, 1, T, S)` says, as a QSA indexer's choice); returns
        `(B, Hq, T, D)`, zero at padded queries."""
        b, hq, t, d = q.shape
        self._write_step(k, v, step)
        starts, n_new = step.start.tolist(), step.n_new.tolist()
        needed = [self._needed(row, starts[r], n_new[r], allowed, r) for r, row in enumerate(self.rows)]
        missing = False
        if self.frequency:  # count first, so this step's choice already shapes residency
            for row, n, need in zip(self.rows, n_new, needed):
                nb = self._n_blocks(row)
                row.count[:nb] += n if need is None else need
                missing = missing or bool(self._on_host(row, need).any())
        if self._dirty or missing:  # else only resident blocks gained counts: residency stands
            self._rebalance()
        attend_row = self._attend_split if t <= FEW_QUERIES else self._attend_blocks
        if b == 1 and n_new[0] == t:
            return attend_row(self.rows[0], q[0], starts[0], needed[0], None if allowed is None else allowed[0, 0])[None]
        out = q.new_zeros(b, hq, t, d)
        for r, row in enumerate(self.rows):
            if n_new[r] > 0:
                mask = None if allowed is None else allowed[r, 0, :n_new[r]]
                out[r, :, :n_new[r]] = attend_row(row, q[r, :, :n_new[r]], starts[r], needed[r], mask)
        return out

    def _needed(self, row: _Row, start: int, n: int, allowed, r: int) -> torch.Tensor | None:
        """Queries of this step that read each block of the row, `(blocks,)` on the CPU; None when
        every query reads every block (no indexer choice)."""
        n_blocks = self._n_blocks(row)
        if allowed is None:
            return None
        if n == 0:
            return torch.zeros(n_blocks, dtype=torch.long)
        device = allowed.device
        keys = torch.arange(row.n, device=device)
        pos = start + torch.arange(n, device=device)
        sees = allowed[r, 0, :n, :row.n] & (keys[None] <= pos[:, None])  # (n, S)
        pad = n_blocks * self.block - row.n
        per_block = torch.nn.functional.pad(sees, (0, pad)).view(n, n_blocks, self.block).any(-1).sum(0)
        return per_block.cpu()

    def _on_host(self, row: _Row, need: torch.Tensor | None) -> torch.Tensor:
        """`(blocks,)` True where this step reads a block that is not resident."""
        held = row.slot_of[:self._n_blocks(row)] >= 0
        return ~held if need is None else (need > 0) & ~held

    def _attend_split(self, row: _Row, q: torch.Tensor, start: int, need: torch.Tensor | None,
                      allowed: torch.Tensor | None) -> torch.Tensor:
        """Attention of one row's few `(Hq, n, D)` queries in two parts merged by log-sum-exp: the
        resident blocks from the pool, the other needed blocks from host memory, by the host."""
        hq, n, d = q.shape
        h = self.pool_k.shape[0]
        g = hq // h
        qg = q.reshape(h, g * n, d)  # query heads grouped under their KV head (as enable_gqa)
        pos = start + torch.arange(n)
        parts = []
        if self._used and row.pool_pos is not None:
            width = self._used * self.block
            key_pos = row.pool_pos[:width]
            ok = key_pos[None] <= pos.to(q.device)[:, None]  # (n, width): this row's keys, causal
            if allowed is not None:
                ok &= allowed[:, key_pos.clamp(max=allowed.shape[1] - 1)]
            pool_k = self.pool_k[:, :self._used].reshape(h, width, d)
            pool_v = self.pool_v[:, :self._used].reshape(h, width, d)
            parts.append(_block_attention(qg, pool_k, pool_v, ok, g))
        on_host = self._on_host(row, need)
        blocks = on_host.nonzero().flatten().tolist()
        if blocks:
            span = on_host[blocks[0]:blocks[-1] + 1]  # the host blocks and any resident ones between them
            lo, hi = blocks[0] * self.block, min((blocks[-1] + 1) * self.block, row.n)
            ok = None
            if allowed is not None or hi - 1 > start or len(blocks) < len(span):
                ok = span.repeat_interleave(self.block)[:hi - lo][None] & (torch.arange(lo, hi)[None] <= pos[:, None])
                if allowed is not None:
                    ok &= allowed[:, lo:hi].cpu()
            o, lse = _block_attention(qg.cpu(), row.k[:, lo:hi], row.v[:, lo:hi], ok, g)
            parts.append((o.to(q.device), lse.to(q.device)))
        out, lse = parts[0]
        for o, l in parts[1:]:
            out, lse = merge(out, lse, o, l)
        return out.view(h, g, n, d).reshape(hq, n, d).to(q.dtype)

    def _attend_blocks(self, row: _Row, q: torch.Tensor, start: int, need: torch.Tensor | None,
                       allowed: torch.Tensor | None) -> torch.Tensor:
        """Attention of one row's `(Hq, n, D)` queries block by block, merged by log-sum-exp."""
        hq, n, d = q.shape
        h = self.pool_k.shape[0]
        g = hq // h
        qg = q.reshape(h, g * n, d)  # query heads grouped under their KV head (as enable_gqa)
        pos = start + torch.arange(n, device=q.device)
        out = lse = None
        blocks = range(self._n_blocks(row)) if need is None else need.nonzero().flatten().tolist()
        slot_of = row.slot_of.tolist()
        staged = [j for j in blocks if slot_of[j] < 0]
        stage_of: dict[int, int] = {}

        def stage(i: int) -> None:  # copy the i-th staged block into a staging slot
            if i < len(staged):
                slot = self.staging[i % len(self.staging)]
                self._load(row, [staged[i]], [slot], wait=False)
                stage_of[staged[i]] = slot

        stage(0)
        n_staged = 0
        for j in blocks:
            if slot_of[j] >= 0:
                slot = slot_of[j]
            else:
                self._ready()
                slot = stage_of[j]
                n_staged += 1
                if len(self.staging) > 1:
                    stage(n_staged)  # the next copy overlaps this block's math
            lo = j * self.block
            w = min(self.block, row.n - lo)
            ok = None
            if allowed is not None or lo + w - 1 > start:  # else every query sees the whole block
                ok = (lo + torch.arange(w, device=q.device))[None] <= pos[:, None]  # (n, w)
                if allowed is not None:
                    ok = ok & allowed[:, lo:lo + w]
            o, l = _block_attention(qg, self.pool_k[:, slot, :w], self.pool_v[:, slot, :w], ok, g)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
            if slot_of[j] < 0 and len(self.staging) == 1:
                stage(n_staged)  # one staging slot: the next copy waits for this block
        return out.view(h, g, n, d).reshape(hq, n, d).to(q.dtype)

    def _write_step(self, k: torch.Tensor, v: torch.Tensor, step: StepInfo) -> None:
        """Write each row's real new keys/values `(B, H, T, D)` through to host memory."""
        self._setup(k.shape[0], k)
        starts, n_new = step.start.tolist(), step.n_new.tolist()
        for r, row in enumerate(self.rows):
            if n_new[r] > 0:
                self._write(row, k[r, :, :n_new[r]], v[r, :, :n_new[r]], starts[r])
            before = self._n_blocks(row)
            row.n = starts[r] + n_new[r]
            self._dirty = self._dirty or self._n_blocks(row) != before

    def select(self, rows: torch.Tensor) -> None:
        if not self.rows:
            return
        keep = [self.rows[i] for i in torch.as_tensor(rows).tolist()]
        kept = {id(r) for r in keep}
        for slot, own in enumerate(self.owner):
            if own is not None and id(own[0]) not in kept:
                self.owner[slot] = None
        self.rows = keep  # a row kept twice shares its host copy; fine, it is only read
        self._dirty = True

    def track(self, on: bool = True) -> None:
        """Nothing to keep: attention rolls back by length alone (`rollback`)."""

    def rollback(self, n_drop: int) -> None:
        """Nothing to do: `ModelCache.lengths` decides what is attended, later writes overwrite
        the stale positions (host and any resident copy)."""

    def extend(self, other: TieredKVCache) -> None:
        """Append `other`'s rows; their blocks come in as non-resident (this pool loads them)."""
        if not other.rows:
            return
        for row in other.rows:
            row.slot_of.fill_(-1)
            row.pool_pos = None
        if self.pool_k is None and other.pool_k is not None:
            self.pool_k, self.pool_v = other.pool_k, other.pool_v
            self.owner, self.n_resident, self.staging = [None] * other.n_resident, other.n_resident, other.staging
            self._stream = other._stream
        self.rows = self.rows + other.rows
        self._dirty = True

    @property
    def device_bytes(self) -> int:
        return 0 if self.pool_k is None else self.pool_k.nbytes + self.pool_v.nbytes

    @property
    def host_bytes(self) -> int:
        return sum(r.k.nbytes + r.v.nbytes for r in self.rows if r.k is not None)

    @property
    def nbytes(self) -> int:
        return self.device_bytes + self.host_bytes


class TieredQSACache(IndexKeys, TieredKVCache):
    """`TieredKVCache` plus a `QSACache`'s raw indexer keys (kept whole, as `QSACache` keeps them:
    d_idx values per token, small beside the KV; not counted in `device_bytes`)."""

    def __init__(self, config: KVTierConfig, frequency: bool = True):
        super().__init__(config, frequency)


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor | None, g: int):
    """Softmax attention of `(h, g*n, D)` queries over one block's `(h, w, D)` keys where `ok`
    `(n, w)` allows (None: everywhere); returns fp32 output `(h, g*n, D)` and log-sum-exp
    `(h, g*n)`, -inf (and output 0) for a query that sees none of the block."""
    h, gn, d = q.shape
    n, w = gn // g, k.shape[1]
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16):
        bias = None
        if ok is not None:
            bias = torch.zeros(n, w, dtype=q.dtype).masked_fill_(~ok, -math.inf)
            bias = bias[None].expand(g, n, w).reshape(gn, w)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], attn_mask=bias)
        out, lse = out[0].float(), lse[0].float()
        if ok is not None:  # the kernel reports 0, not -inf, for a query that sees nothing
            seen = ok.any(-1)[None].expand(g, n).reshape(gn)
            lse = lse.masked_fill(~seen[None], -math.inf)
        return out, lse
    s = torch.matmul(q.float(), k.float().transpose(1, 2)) * (1.0 / math.sqrt(d))  # (h, g*n, w)
    if ok is not None:
        s = s.view(h, g, n, w).masked_fill(~ok, -math.inf).view(h, gn, w)
    lse = torch.logsumexp(s, -1)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.matmul(torch.exp(s - lse_safe[..., None]), v.float()), lse


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor):
    """Combine two partial softmax attentions (outputs normalised over their own keys, with their
    log-sum-exps) into the attention over both key sets; -inf where neither saw a key."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return out * torch.exp(lse - safe)[..., None] + o * torch.exp(l - safe)[..., None], new


def model_device_bytes(cache) -> int:
    """Device KV bytes of a `ModelCache` (tiered layers only; 0 when none is tiered)."""
    total = 0
    for c in cache.layers:
        c = getattr(c, "mixer", c)
        total += getattr(c, "device_bytes", 0)
    return total


class TieredKV:
    """The KV-cache factory of tiered attention (`Seams.kv_cache`, --kv-device): each attention
    layer's cache keeps at most its share of the `text` budget on the device. The model is built
    with it; `configure(model)` then splits the budget over the model's attention layers (its MTP
    head's included)."""

    def __init__(self, text: str, dtype: torch.dtype, block: int | None = None):
        self.text, self.dtype, self.block = text, dtype, block
        self.config: KVTierConfig | None = None

    def configure(self, model) -> KVTierConfig:
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.config = layer_configs(self.text, layers, self.dtype, self.block or DEFAULT_BLOCK)
        return self.config

    def __call__(self, attention: Attention) -> TieredKVCache:
        if self.config is None:
            raise StrataError("a tiered KV cache was asked for before --kv-device was configured",
                              "call TieredKV.configure(model) once the model is built")
        if isinstance(attention, QSAAttention):  # keep the most selected blocks resident
            return TieredQSACache(self.config, frequency=attention.indexer is not None)
        return TieredKVCache(self.config)
