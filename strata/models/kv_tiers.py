"""Tiered KV cache for long contexts: a bounded pool of KV blocks on the device, the rest in host RAM.

Every row's keys and values live in host memory (pinned on CUDA), written through on each
step; that copy is the authority. The device holds at most `budget // block_bytes` blocks of
`block` tokens (one row, all KV heads) in a fixed pool, split into resident slots and staging
slots. Attention runs block by block with an online softmax (the log-sum-exp merge flash
attention uses; on CPU each block runs torch's flash kernel, which returns the log-sum-exp,
elsewhere a plain fp32 softmax), so it never needs all keys on the device at once:

* a resident block is read in place from the pool;
* any other block the step needs is copied from host memory into a staging slot (CUDA: from
  pinned memory on a side stream, the next block's copy overlapping the current block's math;
  CPU, where a slice of RAM stands in for the device: a real copy into the separate pool, by
  the same code).

Which blocks are resident: for dense attention (every block read every step) the first
("sink") block and the most recent ones; for QSA layers (the indexer picks blocks) the blocks
selected most often, counting per block the queries that selected it, the least selected
evicted. Blocks a QSA step does not select are not read at all.

`device_bytes` is the pool's size, never more than the layer's budget. The output equals the
untiered `KVCache` path up to floating-point reassociation.

Cost: one kernel call per (row, block) per layer. Long dense prefills gain (no (T, S) score
matrix or mask is built); short decode steps pay Python overhead per block (at 8K tokens on the
demo model, about 4x the untiered decode step). Not tiered: a QSA layer's indexer keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.errors import BadOption
from strata.models.cache import StepInfo
from strata.models.qsa import concat_rows

DEFAULT_BLOCK = 256


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
    from strata.tiers.sizes import format_size, parse_size

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
    """One sequence's host copy `(H, capacity, D)`, its resident blocks and selection counts."""

    __slots__ = ("k", "v", "resident", "counts", "n")

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.resident: dict[int, int] = {}  # block -> pool slot
        self.counts: dict[int, int] = {}  # block -> queries that selected it (QSA)
        self.n = 0  # keys written (this row's length after the last step)


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
        self.pool_k: torch.Tensor | None = None  # (slots, H, block, D) on the device
        self.pool_v: torch.Tensor | None = None
        self.owner: list[tuple[_Row, int] | None] = []  # resident slot -> (row, block)
        self.n_resident = 0
        self.staging: list[int] = []
        self.copies = 0  # blocks copied host -> device (resident loads and staged reads)
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
            self.pool_k = k.new_zeros(slots, h, self.block, d)
            self.pool_v = k.new_zeros(slots, h, self.block, d)
            n_stage = 1 if slots == 1 else 2
            self.n_resident = slots - n_stage
            self.staging = list(range(self.n_resident, slots))
            self.owner = [None] * slots
            if k.is_cuda:
                self._stream = torch.cuda.Stream(device=k.device)

    def _write(self, row: _Row, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Write `(H, n, D)` at `start` in the row's host copy (grown by doubling)."""
        end = start + k.shape[1]
        cap = 0 if row.k is None else row.k.shape[1]
        if end > cap:
            new_cap = max(end, 2 * cap, self.block)
            pin = k.is_cuda
            nk = torch.zeros(k.shape[0], new_cap, k.shape[2], dtype=k.dtype, pin_memory=pin)
            nv = torch.zeros(v.shape[0], new_cap, v.shape[2], dtype=v.dtype, pin_memory=pin)
            if row.k is not None:
                nk[:, :cap] = row.k
                nv[:, :cap] = row.v
            row.k, row.v = nk, nv
        row.k[:, start:end] = k.to("cpu")
        row.v[:, start:end] = v.to("cpu")
        # write-through: a resident block just written gets its device copy refreshed
        for j in range(start // self.block, (end - 1) // self.block + 1):
            slot = row.resident.get(j)
            if slot is not None:
                self._load(row, j, slot, wait=True)

    def _load(self, row: _Row, j: int, slot: int, wait: bool) -> None:
        """Copy block j of `row` from host memory into pool slot `slot`."""
        lo = j * self.block
        hi = min(lo + self.block, row.k.shape[1])
        self.copies += 1
        if self._stream is None:
            self.pool_k[slot, :, :hi - lo].copy_(row.k[:, lo:hi])
            self.pool_v[slot, :, :hi - lo].copy_(row.v[:, lo:hi])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.pool_k.device))  # the slot is free to overwrite
        with torch.cuda.stream(self._stream):
            self.pool_k[slot, :, :hi - lo].copy_(row.k[:, lo:hi], non_blocking=True)
            self.pool_v[slot, :, :hi - lo].copy_(row.v[:, lo:hi], non_blocking=True)
        if wait:
            torch.cuda.current_stream(self.pool_k.device).wait_stream(self._stream)

    def _ready(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.pool_k.device).wait_stream(self._stream)

    # ---- residency -----------------------------------------------------------------------------
    def _priority(self, row: _Row, j: int):
        if self.frequency:
            return (row.counts.get(j, 0), j)
        return (j < self.config.sink_blocks, j)  # the sink block, then the most recent

    def _rebalance(self) -> None:
        """Make the `n_resident` best (row, block) pairs resident, evicting the others."""
        if self.n_resident == 0:
            return
        cands = [(self._priority(row, j), r, j) for r, row in enumerate(self.rows)
                 for j in range(math.ceil(row.n / self.block))]
        cands.sort(key=lambda c: c[0], reverse=True)
        want = {(r, j) for _, r, j in cands[:self.n_resident]}
        free = []
        for slot in range(self.n_resident):
            own = self.owner[slot]
            if own is None:
                free.append(slot)
                continue
            row, j = own
            r = next((i for i, x in enumerate(self.rows) if x is row), None)
            if r is None or (r, j) not in want:
                row.resident.pop(j, None)
                self.owner[slot] = None
                free.append(slot)
        for _, r, j in cands[:self.n_resident]:
            row = self.rows[r]
            if j not in row.resident:
                slot = free.pop()
                self._load(row, j, slot, wait=False)
                row.resident[j] = slot
                self.owner[slot] = (row, j)
        self._ready()

    # ---- attention -----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInfo,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's `(B, H, T, D)` keys/values, then attend `q` `(B, Hq, T, D)` to each row's
        keys (causal, and where `allowed` `(B, 1, T, S)` says, as a QSA indexer's choice); returns
        `(B, Hq, T, D)`, zero at padded queries."""
        b, hq, t, d = q.shape
        self._write_step(k, v, step)
        starts, n_new = step.start.tolist(), step.n_new.tolist()
        needed = []
        for r, row in enumerate(self.rows):
            needed.append(self._needed(row, starts[r], n_new[r], allowed, r, q.device))
        if self.frequency:  # count first, so this step's choice already shapes residency
            for row, blocks in zip(self.rows, needed):
                for j, c in blocks:
                    row.counts[j] = row.counts.get(j, 0) + c
        self._rebalance()
        out = q.new_zeros(b, hq, t, d)
        for r, row in enumerate(self.rows):
            if n_new[r] > 0:
                mask = None if allowed is None else allowed[r, 0, :n_new[r]]
                out[r, :, :n_new[r]] = self._attend_row(row, q[r, :, :n_new[r]], starts[r],
                                                        [j for j, _ in needed[r]], mask)
        return out

    def _needed(self, row: _Row, start: int, n: int, allowed, r: int, device) -> list[tuple[int, int]]:
        """(block, queries that read it) for this step of one row."""
        if n == 0:
            return []
        n_blocks = math.ceil(row.n / self.block)
        if allowed is None:
            return [(j, n) for j in range(n_blocks)]
        keys = torch.arange(row.n, device=device)
        pos = start + torch.arange(n, device=device)
        sees = allowed[r, 0, :n, :row.n] & (keys[None] <= pos[:, None])  # (n, S)
        pad = n_blocks * self.block - row.n
        per_block = torch.nn.functional.pad(sees, (0, pad)).view(n, n_blocks, self.block).any(-1).sum(0)
        return [(j, c) for j, c in enumerate(per_block.tolist()) if c > 0]

    def _attend_row(self, row: _Row, q: torch.Tensor, start: int, blocks: list[int],
                    allowed: torch.Tensor | None) -> torch.Tensor:
        """Attention of one row's `(Hq, n, D)` queries over `blocks`, merged by log-sum-exp."""
        hq, n, d = q.shape
        h = self.pool_k.shape[1]
        g = hq // h
        qg = q.reshape(h, g * n, d)  # query heads grouped under their KV head (as enable_gqa)
        pos = start + torch.arange(n, device=q.device)
        out = lse = None
        staged = [j for j in blocks if j not in row.resident]
        stage_of: dict[int, int] = {}

        def stage(i: int) -> None:  # copy the i-th staged block into a staging slot
            if i < len(staged):
                slot = self.staging[i % len(self.staging)]
                self._load(row, staged[i], slot, wait=False)
                stage_of[staged[i]] = slot

        stage(0)
        n_staged = 0
        for j in blocks:
            if j in row.resident:
                slot = row.resident[j]
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
            o, l = _block_attention(qg, self.pool_k[slot, :, :w], self.pool_v[slot, :, :w], ok, g)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
            if j not in row.resident and len(self.staging) == 1:
                stage(n_staged)  # one staging slot: the next copy waits for this block
        return out.view(h, g, n, d).reshape(hq, n, d).to(q.dtype)

    def _write_step(self, k: torch.Tensor, v: torch.Tensor, step: StepInfo) -> None:
        """Write each row's real new keys/values `(B, H, T, D)` through to host memory."""
        self._setup(k.shape[0], k)
        starts, n_new = step.start.tolist(), step.n_new.tolist()
        for r, row in enumerate(self.rows):
            if n_new[r] > 0:
                self._write(row, k[r, :, :n_new[r]], v[r, :, :n_new[r]], starts[r])
            row.n = starts[r] + n_new[r]

    # ---- the KVCache interface ----------------------------------------------------------------
    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor, step: StepInfo):
        """As `KVCache.update_and_fetch`: write, then return every key and value `(B, H, S, D)`,
        gathered from host memory (outside the device budget; `attend` is the bounded path)."""
        b, h, t, d = k.shape
        self._write_step(k, v, step)
        end = int((step.start + t).max())
        keys, values = k.new_zeros(b, h, end, d), v.new_zeros(b, h, end, d)
        for r, row in enumerate(self.rows):
            if row.k is not None:
                m = min(end, row.k.shape[1])
                keys[r, :, :m] = row.k[:, :m].to(k.device)
                values[r, :, :m] = row.v[:, :m].to(v.device)
        return keys, values

    def select(self, rows: torch.Tensor) -> None:
        if not self.rows:
            return
        keep = [self.rows[i] for i in torch.as_tensor(rows).tolist()]
        kept = {id(r) for r in keep}
        for slot, own in enumerate(self.owner):
            if own is not None and id(own[0]) not in kept:
                self.owner[slot] = None
        self.rows = keep  # a row kept twice shares its host copy; fine, it is only read

    def rollback(self, n_drop: int) -> None:
        """Nothing to do: `ModelCache.lengths` decides what is attended, later writes overwrite
        the stale positions (host and any resident copy)."""

    def extend(self, other: "TieredKVCache") -> None:
        """Append `other`'s rows; their blocks come in as non-resident (this pool loads them)."""
        if not other.rows:
            return
        for row in other.rows:
            row.resident = {}
        if self.pool_k is None and other.pool_k is not None:
            self.pool_k, self.pool_v = other.pool_k, other.pool_v
            self.owner, self.n_resident, self.staging = [None] * len(other.owner), other.n_resident, other.staging
            self._stream = other._stream
        self.rows = self.rows + other.rows

    @property
    def device_bytes(self) -> int:
        return 0 if self.pool_k is None else self.pool_k.nbytes + self.pool_v.nbytes

    @property
    def host_bytes(self) -> int:
        return sum(r.k.nbytes + r.v.nbytes for r in self.rows if r.k is not None)

    @property
    def nbytes(self) -> int:
        return self.device_bytes + self.host_bytes


class TieredQSACache(TieredKVCache):
    """`TieredKVCache` plus a `QSACache`'s raw indexer keys (kept whole, as `QSACache` keeps them:
    d_idx values per token, small beside the KV; not counted in `device_bytes`)."""

    def __init__(self, config: KVTierConfig, frequency: bool = True):
        super().__init__(config, frequency)
        self.ik: torch.Tensor | None = None

    def update_index_keys(self, k: torch.Tensor, step: StepInfo) -> torch.Tensor:
        from strata.models.qsa import QSACache

        return QSACache.update_index_keys(self, k, step)

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        if self.ik is not None:
            self.ik = self.ik[rows]

    def extend(self, other: "TieredQSACache") -> None:
        if not other.rows:
            return
        mine = self.ik
        super().extend(other)
        self.ik = concat_rows(mine, other.ik)

    @property
    def nbytes(self) -> int:
        return super().nbytes + (0 if self.ik is None else self.ik.nbytes)


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


def install(model, text, dtype: torch.dtype, block: int = DEFAULT_BLOCK) -> KVTierConfig:
    """Make every attention layer of `model` (MTP's included) build tiered caches."""
    from strata.models.layers import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    config = layer_configs(text, layers, dtype, block)
    for a in layers:
        a.kv_tier = config
    return config
