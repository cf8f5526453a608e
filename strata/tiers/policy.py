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
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

# The adaptive policy's memory, in mean gaps between two uses of one expert (E / k tokens):
# a use counts half after 2 gaps. Swept on the demo's held-out trace (bench_cache_policy.py):
# 1-2 gaps beat 4 at every cache size (+1.2 points at 30 %, +0.5 at 70 %); much shorter
# degrades to LRU, much longer to plain LFU.
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

    def place(self, misses: list[int], protected: set[int]) -> Placement:
        admitted, rejected = [], []
        for key in misses:
            if len(self.resident) < self.capacity:
                admitted.append((key, None))
                self._insert(key)
                continue
            victim = self.victim(protected)
            if victim is None or not self.admit(key, victim):
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
