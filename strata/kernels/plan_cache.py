"""Plans (what a product by one tensor needs, worked out once: its kernel, pointers, shapes) kept by
the tensor's identity and dropped when the tensor is freed.

A plan never holds the tensor itself, so a disk-homed expert read for one use and dropped is not
kept alive by its plan (a cache that held them kept every expert ever read, past --ram-memory).
"""

from __future__ import annotations

import weakref
from typing import Callable


class PlanCache:
    """id(tensor) -> (weak ref to it, key, plan); an entry goes when its tensor does."""

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object, object]] = {}

    def get(self, t, key, make: Callable, arg):
        """The plan for tensor `t` and `key` (what else the plan depends on), `make(arg)` on a miss."""
        hit = self._entries.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == key:
            return hit[2]
        plan = make(arg)
        k, entries = id(t), self._entries
        entries[k] = (weakref.ref(t, lambda _r: entries.pop(k, None)), key, plan)
        return plan

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
