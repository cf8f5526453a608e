"""Which rank holds which experts, and the shard's view of the model file for planning.

Every rank computes the same partition from the same file and flags, so nothing is sent to agree
on it (a fingerprint is compared at start-up). Per layer, experts are split so each rank's bytes
are balanced, rank 0's dense weights counted against its share; with a routing trace, the experts
of a layer are dealt to ranks by expected load (heaviest first, to the least-loaded rank that has
room), so no rank waits on a hot set held by another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from strata.errors import BadOption
from strata.tiers.plan import EXPERT_TENSOR


@dataclass(frozen=True, slots=True)
class Shares:
    """Per MoE layer, per rank, the sorted expert ids that rank holds."""

    world: int
    layers: dict[int, list[list[int]]]
    n_experts: dict[int, int]

    def of(self, rank: int) -> dict[int, list[int]]:
        return {layer: ranks[rank] for layer, ranks in self.layers.items() if ranks[rank]}

    def owners(self, layer: int) -> torch.Tensor:
        """(E,) rank holding each expert of `layer`."""
        out = torch.empty(self.n_experts[layer], dtype=torch.long)
        for rank, experts in enumerate(self.layers[layer]):
            out[experts] = rank
        return out

    def fingerprint(self) -> str:
        text = repr(sorted((k, v) for k, v in self.layers.items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def expert_tensors(source) -> dict[int, tuple[str, str, str]]:
    """MoE layer -> its (gate, up, down) stacked expert tensors."""
    found: dict[int, dict[str, str]] = {}
    for name in source.names():
        m = EXPERT_TENSOR.match(name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = name
    return {layer: (p["gate"], p["up"], p["down"]) for layer, p in sorted(found.items())}


def partition(source, world: int, trace: str | None = None) -> Shares:
    """Split each MoE layer's experts over `world` ranks (see the module docstring)."""
    if world < 1:
        raise BadOption(f"--world-size must be at least 1, not {world}")
    layers = expert_tensors(source)
    sizes = {n: source.info(n)[2] for n in source.names()}
    expert_names = {n for names in layers.values() for n in names}
    dense = sum(b for n, b in sizes.items() if n not in expert_names)
    experts = sum(sizes[n] for n in expert_names)
    fractions = _fractions(world, dense, experts)
    load = _trace_load(trace, layers) if trace else {}
    out, counts = {}, {}
    for layer, names in layers.items():
        n = source.info(names[0])[1][0]
        quota = _quotas(n, fractions)
        out[layer] = _deal(n, quota, load.get(layer))
        counts[layer] = n
    return Shares(world, out, counts)


def _fractions(world: int, dense: int, experts: int) -> list[float]:
    """Each rank's share of the expert bytes, so that rank 0's dense weights plus its experts
    weigh what every other rank's experts weigh (rank 0 holds none when dense weights exceed it)."""
    if world == 1 or experts == 0:
        return [1.0] + [0.0] * (world - 1)
    per_rank = (dense + experts) / world
    first = max(0.0, per_rank - dense) / experts
    rest = (1.0 - first) / (world - 1)
    return [first] + [rest] * (world - 1)


def _quotas(n: int, fractions: list[float]) -> list[int]:
    """Expert counts per rank summing to n, by largest remainder."""
    raw = [f * n for f in fractions]
    quota = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: (quota[i] - raw[i], i))[: n - sum(quota)]:
        quota[i] += 1
    return quota


def _deal(n: int, quota: list[int], load: np.ndarray | None) -> list[list[int]]:
    if load is None:  # contiguous ranges: one read per projection per rank
        out, start = [], 0
        for q in quota:
            out.append(list(range(start, start + q)))
            start += q
        return out
    out = [[] for _ in quota]
    totals = [0.0] * len(quota)
    for e in sorted(range(n), key=lambda e: (-float(load[e]), e)):
        rank = min((r for r in range(len(quota)) if len(out[r]) < quota[r]), key=lambda r: (totals[r], r))
        out[rank].append(e)
        totals[rank] += float(load[e])
    return [sorted(x) for x in out]


def _trace_load(path: str, layers: dict) -> dict[int, np.ndarray]:
    """Per layer, how often the trace routed to each expert."""
    from strata.tiers.trace import load_trace

    trace = load_trace(path)
    out: dict[int, np.ndarray] = {}
    start = 0
    for layer, n in zip(trace.layer.tolist(), trace.tokens.tolist()):
        ids = trace.ids[start:start + n].reshape(-1)
        start += n
        if layer in layers:
            counts = out.setdefault(layer, np.zeros(trace.n_experts))
            np.add.at(counts, ids, 1)
    return out


class ShardSource:
    """A weight source showing one rank its share: each expert tensor cut to the share's count
    (so the planner sizes homes and caches for the share alone), dense tensors only on rank 0."""

    def __init__(self, source, share: dict[int, list[int]], with_dense: bool):
        self.source, self.share = source, share
        self.file = getattr(source, "file", None)
        self.description = getattr(source, "description", "")
        layers = expert_tensors(source)
        self._layer_of = {n: layer for layer, names in layers.items() for n in names}
        self._names = [n for n in source.names() if (self._layer_of[n] in share if n in self._layer_of else with_dense)]

    def names(self) -> list[str]:
        return list(self._names)

    def info(self, name: str):
        qtype, shape, nbytes = self.source.info(name)
        layer = self._layer_of.get(name)
        if layer is None:
            return qtype, shape, nbytes
        n = len(self.share[layer])
        return qtype, (n, *shape[1:]), nbytes // shape[0] * n
