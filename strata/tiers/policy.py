"""Which experts the device cache keeps: replacement and admission, shared by runtime and simulator.

Keys are integers (`layer * n_experts + expert`). Per step, `access(keys)` records that
keys were used; `place(misses, protected)` decides, per miss, whether to copy it in (and
whom it evicts) or leave it to the CPU lane. Keys of the current step are protected.

- `lru`: recency only; every miss is copied in.
- `lfu`: frequency only (ties broken by recency); every miss is copied in.
- `adaptive`: frequency with recency (an exponentially aged count, LRFU), so it learns a
  conversation's hot set and forgets an old one; a miss is copied in only when its aged
  count reaches the victim's (frequency admission), so one-off experts stay on the CPU.
- `static`: a fixed hot set (a ranking from a trace, or the first experts seen); never evicts.

`SlotMap` puts a policy to work over the cache's regions (decode, prefill) and prefetches;
the runtime's `DeviceCache` and `strata cache-sim` both drive it, so they count alike.
Measured on the demo's held-out trace at 30 % of experts (76 slots, bench_cache_policy.py),
demand paging: adaptive 62.4 % beats ARC (57.7), LeCaR (59.9), a fixed per-layer split of
the slots (60.8) and also admitting recently evicted experts (62.3); MIN is 79.2. With
prefetch: adaptive 82.1 %, LeCaR 80.2, ARC 79.2, LRU 77.8.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

# The adaptive policy's memory, in mean gaps between two uses of one expert (E / k tokens):
# a use counts half after 2 gaps. Swept on the demo's held-out trace (bench_cache_policy.py):
# 1-2 gaps beat 4 at every cache size (+1.2 points at 30 %, +0.5 at 70 %); much shorter
# degrades to LRU, much longer to plain LFU. With prefetch, 2 gaps is also best (30 %: 82.3
# vs 82.2 at 1 gap and 81.5 at 0.5).
HALF_LIFE_GAPS = 2.0


def half_life_tokens(n_experts: int, k: int) -> float:
    return HALF_LIFE_GAPS * n_experts / max(k, 1)

Placement = tuple[list[tuple[int, int | None]], list[int]]  # (admitted (key, victim)), rejected


class Policy:
    """Base: capacity in slots and the resident set; subclasses choose victims and admission."""

    name = "?"
    admit_all = True  # admission: copy every miss in (when a victim exists)

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.resident: set[int] = set()

    def access(self, keys: list[int]) -> None:
        pass

    def victim(self, protected: set[int]) -> int | None:
        raise NotImplementedError

    def admit(self, key: int, victim: int) -> bool:
        return self.admit_all

    def place(self, misses: list[int], protected: set[int], force: bool = False) -> Placement:
        """Per miss: copy in (evicting the victim) or reject; `force` skips admission (prefetch)."""
        admitted, rejected = [], []
        for key in misses:
            if len(self.resident) < self.capacity:
                admitted.append((key, None))
                self._insert(key)
                continue
            victim = self.victim(protected)
            if victim is None or not (force or self.admit(key, victim)):
                rejected.append(key)
                continue
            self._remove(victim)
            self._insert(key)
            admitted.append((key, victim))
        return admitted, rejected

    def _insert(self, key: int) -> None:
        self.resident.add(key)

    def _remove(self, key: int) -> None:
        self.resident.discard(key)


class LRU(Policy):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()

    def access(self, keys):
        for k in keys:
            if k in self.order:
                self.order.move_to_end(k)

    def victim(self, protected):
        return next((k for k in self.order if k not in protected), None)

    def _insert(self, key):
        super()._insert(key)
        self.order[key] = None

    def _remove(self, key):
        super()._remove(key)
        self.order.pop(key, None)


class Scored(Policy):
    """Keeps a score per key (resident or not) in an array; the victim has the lowest score."""

    def __init__(self, capacity: int, n_keys: int):
        super().__init__(capacity)
        self.score = np.full(n_keys, -np.inf)
        self.keys = np.zeros(capacity, dtype=np.int64)  # resident keys, packed
        self.index: dict[int, int] = {}  # key -> position in self.keys

    def victim(self, protected):
        if not self.index:
            return None
        resident = self.keys[:len(self.index)]
        scores = self.score[resident].copy()
        for k in protected:
            if k in self.index:
                scores[self.index[k]] = np.inf
        i = int(np.argmin(scores))
        return None if scores[i] == np.inf else int(resident[i])

    def _insert(self, key):
        super()._insert(key)
        self.index[key] = len(self.index)
        self.keys[self.index[key]] = key

    def _remove(self, key):
        super()._remove(key)
        i, last = self.index.pop(key), len(self.index)
        if i != last:  # move the last resident key into the hole
            moved = int(self.keys[last])
            self.keys[i], self.index[moved] = moved, i


class LFU(Scored):
    """Use counts, with a small recency term so equal counts evict the least recent."""

    name = "lfu"

    def __init__(self, capacity: int, n_keys: int):
        super().__init__(capacity, n_keys)
        self.score[:] = 0.0
        self.clock = 0

    def access(self, keys):
        self.clock += 1
        for k in keys:
            self.score[k] = math.floor(self.score[k]) + 1 + self.clock * 1e-9


class Adaptive(Scored):
    """LRFU: score = sum over past uses of 2^(-age / half_life), stored in log form.

    `score[k]` holds log(count aged to time 0); comparing at one instant only needs the
    stored numbers, and they never overflow (they grow linearly with time).
    """

    name = "adaptive"
    admit_all = False

    def __init__(self, capacity: int, n_keys: int, half_life: float = 256.0):
        super().__init__(capacity, n_keys)
        self.rate = math.log(2) / half_life
        self.clock = 0

    def access(self, keys):
        self.clock += 1
        now = self.clock * self.rate
        for k in keys:
            self.score[k] = np.logaddexp(self.score[k], now)

    def admit(self, key, victim):
        return self.admit_all or self.score[key] >= self.score[victim]


class Static(Policy):
    """A fixed hot set: filled from a ranking (or by first use) and never changed."""

    name = "static"
    admit_all = False

    def __init__(self, capacity: int, ranking: list[int] | None = None):
        super().__init__(capacity)
        self.preload = list(ranking or [])[:capacity]

    def victim(self, protected):
        return None


@dataclass(slots=True)
class Region:
    """Slots under one policy: `main` for decode, `prefill` for the slots kept for prefill."""

    name: str
    policy: Policy
    free: list[int] = field(default_factory=list)


Copies = list[tuple[int, int]]  # (key, slot) to copy in


class SlotMap:
    """Which key sits in which slot, over regions: the device cache's decisions, without its bytes.

    The runtime's `DeviceCache` and the simulator's replay both call this, so a simulated
    hit rate is the runtime's. Prefill misses and prefetches go to the `prefill` region when
    there is one; decode misses and prefetches to `main`. A prefill's uses do not count towards the main
    policy's recency or frequency when prefill has its own region, so a long prompt neither
    evicts the decode hot set nor outweighs it in later admissions.

    A prefetch skips admission (admission weighs a demand miss against computing it on the
    CPU; a prediction says the expert is about to be used), and every predicted expert on
    the device is pinned until its layer has run, so no other placement evicts it unused. A
    prediction is not a use: it changes no recency or frequency.
    """

    def __init__(self, regions: list[Region], n_experts: int):
        self.regions = regions
        self.n_experts = n_experts  # keys are layer * n_experts + expert
        self.where: dict[int, int] = {}  # key -> slot
        self.pinned: set[int] = set()  # prefetched for a layer that has not run yet

    def request(self, keys: list[int], prefill: bool) -> tuple[list[int], Copies, list[int]]:
        """(hits, misses copied in with their slots, misses left to the CPU) for one step's keys."""
        hits = [k for k in keys if k in self.where]
        misses = [k for k in keys if k not in self.where]
        region = self.region(prefill)
        for r in self.regions:
            if not (prefill and r.name == "main" and region is not None and region.name == "prefill"):
                r.policy.access(keys)
        if keys and self.pinned:
            layer = keys[0] // self.n_experts
            self.pinned = {k for k in self.pinned if k // self.n_experts != layer}
        if region is None:
            return hits, [], misses
        admitted, rejected = region.policy.place(misses, set(keys) | self.pinned)
        return hits, self._assign(region, admitted), rejected

    def prefetch(self, keys: list[int], prefill: bool = False) -> Copies:
        """Predicted keys copied in ahead of use (into the region the step's misses go to), pinned
        until their layer runs."""
        region = self.region(prefill)
        misses = [k for k in keys if k not in self.where]
        if region is None:
            return []
        admitted, _ = region.policy.place(misses, set(keys) | self.pinned, force=True) if misses else ([], [])
        copies = self._assign(region, admitted)
        self.pinned.update(k for k in keys if k in self.where)
        return copies

    def preload(self) -> Copies:
        """A static hot set known up front, placed before any request."""
        out = []
        for region in self.regions:
            keys = [k for k in getattr(region.policy, "preload", []) if k not in self.where]
            out += self._assign(region, region.policy.place(keys, set())[0])
        return out

    def region(self, prefill: bool) -> Region | None:
        by_name = {r.name: r for r in self.regions if r.policy.capacity > 0}
        return by_name.get("prefill") if prefill and "prefill" in by_name else by_name.get("main")

    def _assign(self, region: Region, admitted) -> Copies:
        out = []
        for key, victim in admitted:
            slot = self.where.pop(victim) if victim is not None else region.free.pop()
            self.where[key] = slot
            out.append((key, slot))
        return out


def regions(policy: Policy, reserve: int = 0) -> list[Region]:
    """The main region (slots 0..) and, with a reserve, an LRU prefill region after it."""
    main = policy.capacity
    out = [Region("main", policy, list(range(main - 1, -1, -1)))]
    if reserve:
        out.append(Region("prefill", LRU(reserve), list(range(main + reserve - 1, main - 1, -1))))
    return out


def make_policy(name: str, capacity: int, n_keys: int, admission: str = "auto", n_layers: int = 1,
                ranking=None, half_life: float = 64.0) -> Policy:
    """A policy by name; `admission` may override its own rule (always / frequency).

    `half_life` is in tokens; policies tick once per layer step, so it is scaled by the layers.
    """
    half_life = half_life * max(n_layers, 1)
    if name == "lru":
        policy = LRU(capacity)
    elif name == "lfu":
        policy = LFU(capacity, n_keys)
    elif name == "adaptive":
        policy = Adaptive(capacity, n_keys, half_life)
    elif name == "static":
        policy = Static(capacity, ranking)
    else:
        raise ValueError(f"unknown policy {name!r}")
    if admission == "always":
        policy.admit_all = True
    elif admission == "frequency" and isinstance(policy, Scored):
        policy.admit_all = False
        policy.admit = lambda key, victim: policy.score[key] >= policy.score[victim]
    return policy
