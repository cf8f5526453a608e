"""Per-layer cache objects and the batch bookkeeping shared by every layer of a forward.

Rows of a batch are independent sequences with their own lengths, so prompts of
different lengths prefill together (right-padded) and decode steps of unrelated
requests run as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from strata.kernels import decode_ops
from strata.kernels.gpu.graphs import boundary
from strata.kernels.threads import one_thread_if_small


_HOST = torch.device("cpu")


@dataclass(slots=True)
class StepInfo:
    """What one forward adds: `n_new[b]` real tokens per row, written after `start[b]`.

    `start` and `n_new` stay on the host, so every shape and length decision (cache growth,
    the last real position, whether a row is padded) is made without reading the device;
    `device` is where the index tensors a layer needs (positions, masks) are built, and
    `on(device)` gives the same step for a layer on another device.
    """

    start: torch.Tensor  # (B,) cache length before this step, on the host
    n_new: torch.Tensor  # (B,) valid new tokens in each row, on the host
    width: int  # T, the padded number of new tokens
    device: torch.device = _HOST
    # what every layer asks of the step (all_real, positions, token_mask), built once per step: each
    # was a few torch operators per layer (the full-size flagship: 48 layers, ~15 ms a decode token)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def on(self, device: torch.device) -> "StepInfo":
        return self if device == self.device else StepInfo(self.start, self.n_new, self.width, device)

    @property
    def end(self) -> int:
        """The longest row's length after this step (a host value: no device read)."""
        return int((self.start + self.width).max())

    @property
    def all_real(self) -> bool:
        """No padded position in this step (every decode step of a batch of single tokens)."""
        if "all_real" not in self._memo:
            self._memo["all_real"] = bool((self.n_new == self.width).all())
        return self._memo["all_real"]

    @property
    def positions(self) -> torch.Tensor:  # (B, T); shared by the step's layers: not to be written
        if "positions" not in self._memo:
            self._memo["positions"] = _to(self.start[:, None] + torch.arange(self.width), self.device)
        return self._memo["positions"]

    @property
    def token_mask(self) -> torch.Tensor:  # (B, T) True where the token is real; not to be written
        if "token_mask" not in self._memo:
            self._memo["token_mask"] = _to(torch.arange(self.width)[None, :] < self.n_new[:, None], self.device)
        return self._memo["token_mask"]

    def attention_mask(self, n_keys: int) -> torch.Tensor:  # (B, 1, T, S) True = may attend
        keys = torch.arange(n_keys, device=self.device)[None, None, :]
        return (keys <= self.positions[:, :, None])[:, None]

    def last_real(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, ...) each row's last real position of x (B, T, ...), indexed on x's device."""
        rows = torch.arange(x.shape[0], device=x.device)
        return x[rows, _to((self.n_new - 1).clamp(min=0), x.device)][:, None]


def sdpa(q, k, v, mask, enable_gqa: bool) -> torch.Tensor:
    """Attention; off the CPU through the `strata::attention` custom op, whose fake implementation
    lets a device step be checked (and traced) without a device."""
    if q.device.type == "cpu":
        with one_thread_if_small(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    from strata.kernels.gpu import ops  # noqa: F401  (registers torch.ops.strata.*)

    return torch.ops.strata.attention(q, k, v, mask, enable_gqa)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host-built index tensor on `device`: asynchronous, so the host never waits."""
    return t if device == t.device else t.to(device, non_blocking=True)


class KVCache:
    """Keys and values of one attention layer, `(B, H_kv, capacity, D)`, grown by doubling."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update_and_fetch(self, k: torch.Tensor, v: torch.Tensor, step: StepInfo):
        """Write this step's `(B, H, T, D)` keys/values at each row's offset; return all keys."""
        b, h, t, _ = k.shape
        end = step.end
        self._reserve(b, h, end, k, v)
        if b == 1:  # one row (every decode step of a single request): a slice, not a scatter
            self.k[:, :, end - t:end] = k
            self.v[:, :, end - t:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        idx = step.positions[:, None, :, None].expand(b, h, t, k.shape[-1])
        self.k.scatter_(2, idx, k)
        self.v.scatter_(2, idx.expand(b, h, t, v.shape[-1]), v)
        return self.k[:, :, :end], self.v[:, :, :end]

    @boundary  # a length that grows every step: compiled decode steps attend eagerly (kernels/gpu/graphs.py)
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInfo,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's `(B, H, T, D)` keys/values, then attend `q` `(B, Hq, T, D)` to every key
        (causal, and where `allowed` `(B, 1, T, S)` says, as a QSA indexer's choice). Every
        attention cache, tiered ones included, offers this."""
        keys, values = self.update_and_fetch(k, v, step)
        if allowed is None and q.shape[0] == 1 and q.shape[2] == 1:
            mask = None  # one row's one new token: every key written so far is its past
        else:
            if allowed is None and q.device.type == "cpu" and keys.data_ptr() == self.k.data_ptr():
                # a verify pass or a decode batch: one C call, each row as its one-token step attends
                out = decode_ops.try_attend_rows(q, self.k, self.v, step.start)
                if out is not None:
                    return out
            mask = _to(step.attention_mask(keys.shape[2]), q.device)  # (B, 1, T, S)
            if allowed is not None:
                mask = mask & allowed
        return sdpa(q, keys, values, mask, q.shape[1] != keys.shape[1])

    def _reserve(self, b, h, end, k, v):
        cap = 0 if self.k is None else self.k.shape[2]
        if end <= cap:
            return
        new_cap = max(end, 2 * cap, 16)
        nk = k.new_zeros(b, h, new_cap, k.shape[-1])
        nv = v.new_zeros(b, h, new_cap, v.shape[-1])
        if self.k is not None:
            nk[:, :, :cap] = self.k
            nv[:, :, :cap] = self.v
        self.k, self.v = nk, nv

    def select(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]

    def track(self, on: bool = True) -> None:
        """Nothing to keep: attention rolls back by length alone (`rollback`)."""

    def rollback(self, n_drop: int) -> None:
        """Forget the last `n_drop` positions: nothing to do, `ModelCache.lengths` decides what
        is attended and later writes overwrite the stale entries."""

    def extend(self, other: "KVCache") -> None:
        """Append `other`'s rows after these (a prefilled request joins a running batch).

        Capacities may differ: the smaller is zero-padded, and the padding is never attended
        because each row's keys past its own length are masked. A cache that has run no
        forward yet holds no tensors and is taken to hold no rows.
        """
        if other.k is None:
            return
        if self.k is None:
            self.k, self.v = other.k, other.v
            return
        cap = max(self.k.shape[2], other.k.shape[2])
        self.k = torch.cat([_pad_seq(self.k, cap), _pad_seq(other.k, cap)])
        self.v = torch.cat([_pad_seq(self.v, cap), _pad_seq(other.v, cap)])

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes


def _pad_seq(t: torch.Tensor, cap: int) -> torch.Tensor:
    """Zero-pad `(B, H, S, D)` along S to `cap`."""
    if t.shape[2] == cap:
        return t
    out = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
    out[:, :, : t.shape[2]] = t
    return out


class ModelCache:
    """All layers' caches plus each row's length; the model advances it after a forward."""

    def __init__(self, layers: list, batch: int):
        self.layers = layers
        self.lengths = torch.zeros(batch, dtype=torch.long)

    def step(self, width: int, n_new: torch.Tensor | None = None) -> StepInfo:
        if n_new is None:
            n_new = torch.full_like(self.lengths, width)
        return StepInfo(self.lengths.clone(), n_new, width)

    def advance(self, step: StepInfo) -> None:
        self.lengths = self.lengths + step.n_new

    def select(self, rows) -> None:
        """Keep only `rows` (a finished request leaves the batch)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        self.lengths = self.lengths[rows]
        for c in self.layers:
            c.select(rows)

    def extend(self, other: "ModelCache") -> None:
        """Append `other`'s rows after these, layer by layer (each layer cache's `extend`).

        Continuous batching prefills a new request alone, then merges it into the running
        batch with this; `other` is consumed (its tensors may be shared, not copied).
        """
        if len(other.layers) != len(self.layers):
            raise ValueError(f"cannot merge a cache of {len(other.layers)} layers into one of {len(self.layers)}")
        for mine, theirs in zip(self.layers, other.layers):
            mine.extend(theirs)
        self.lengths = torch.cat([self.lengths, other.lengths])

    def track(self, on: bool = True) -> None:
        """Speculative decoding: from now on, layers with a recurrent state keep what
        `rollback` needs to undo part of the next forward (see `GDNCache.track`)."""
        for c in self.layers:  # every layer cache has track and rollback (attention's do nothing)
            c.track(on)

    def rollback(self, n_drop) -> None:
        """Drop every row's last `n_drop` positions (rejected draft tokens): one count for all
        rows, or a (B,) tensor of counts, one per row.

        Attention caches only shorten `lengths`; a recurrent layer restores its state to the
        one after the kept positions, which needs `track()` on before the forward that wrote
        them, and can undo only that last forward."""
        if isinstance(n_drop, torch.Tensor):
            if not bool((n_drop > 0).any()):
                return
        elif n_drop <= 0:
            return
        if bool((self.lengths < n_drop).any()):
            raise ValueError(f"cannot drop {n_drop} positions from rows of lengths {self.lengths.tolist()}")
        for c in self.layers:
            c.rollback(n_drop)
        self.lengths = self.lengths - n_drop

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


class PLECache:
    """A PLE layer's per-row state: its last ngram_size-1 token ids and its conv window."""

    def __init__(self):
        self.context: torch.Tensor | None = None  # (B, ngram_size - 1) long
        self.conv: torch.Tensor | None = None  # (B, (K-1) * dilation, hc*hidden)
        self.tracking = False  # speculative decoding: keep what `rollback` needs
        self.undo: tuple | None = None  # the last forward's (context before it, its tokens, n_new)
        self.window: torch.Tensor | None = None  # its conv inputs after the state it started from

    def track(self, on: bool = True) -> None:
        self.tracking, self.undo, self.window = on, None, None

    def rollback(self, n_drop: int) -> None:
        """Undo the last `n_drop` real tokens of the last (tracked) forward: the n-gram context
        and the conv state are re-read at the kept end of [before | that forward's tokens]."""
        if self.undo is None or self.window is None:
            raise ValueError("PLECache.rollback needs track() on before the forward it undoes")
        context, tokens, n_new = self.undo
        keep = n_new - n_drop
        if bool((keep < 0).any()):
            raise ValueError(f"cannot drop {n_drop} tokens from a forward of {n_new.tolist()}")
        hist = torch.cat([context, tokens], dim=1)
        self.context = hist.gather(1, keep[:, None] + torch.arange(context.shape[1]))
        w = self.window
        idx = keep.to(w.device)[:, None] + torch.arange(self.conv.shape[1], device=w.device)
        self.conv = w.gather(1, idx[..., None].expand(-1, -1, w.shape[2]))
        self.undo = (context, tokens, keep)

    def select(self, rows: torch.Tensor) -> None:
        if self.context is not None:
            self.context = self.context[rows]
        if self.conv is not None:
            self.conv = self.conv[rows]

    def extend(self, other: "PLECache") -> None:
        for attr in ("context", "conv"):
            theirs, mine = getattr(other, attr), getattr(self, attr)
            if theirs is not None:
                setattr(self, attr, theirs if mine is None else torch.cat([mine, theirs]))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.context, self.conv) if t is not None)


class LayerCache:
    """The cache of a layer with PLE: the mixer's (`GDNCache`) and the PLE's."""

    def __init__(self, mixer, ple: PLECache):
        self.mixer, self.ple = mixer, ple

    def select(self, rows) -> None:
        self.mixer.select(rows)
        self.ple.select(rows)

    def track(self, on: bool = True) -> None:
        self.mixer.track(on)
        self.ple.track(on)

    def rollback(self, n_drop: int) -> None:
        self.mixer.rollback(n_drop)
        self.ple.rollback(n_drop)

    def extend(self, other: "LayerCache") -> None:
        self.mixer.extend(other.mixer)
        self.ple.extend(other.ple)

    @property
    def nbytes(self) -> int:
        return self.mixer.nbytes + self.ple.nbytes
