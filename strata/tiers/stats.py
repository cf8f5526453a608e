"""Counters of the tiered runtime, per MoE layer and in all.

A request is one expert used by one layer in one forward pass (all its tokens at once):
the unit the cache serves and a copy moves. Counts are cumulative since load, so a
conversation's learning shows across calls.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class LayerCounts:
    hits: int = 0  # found on the device
    misses: int = 0  # not found: copied in, or computed on the CPU
    copied: int = 0  # misses copied in and computed on the device
    cpu_experts: int = 0  # misses computed on the CPU from their home
    bytes_copied: int = 0  # on demand and by prefetch
    prefetched: int = 0  # experts copied in ahead of use
    prefetch_hits: int = 0  # of those, used before being evicted
    predicted: int = 0  # experts the next-layer prediction named
    predicted_used: int = 0  # of those, used
    used_when_predicted: int = 0  # experts used in steps that had a prediction


class TierStats:
    def __init__(self):
        self.layers: dict[int, LayerCounts] = {}
        self.prediction: dict[int, set[int]] = {}
        self.prefetched_keys: set[int] = set()

    def layer(self, layer: int) -> LayerCounts:
        return self.layers.setdefault(layer, LayerCounts())

    def predicted(self, layer: int, experts: set[int]) -> None:
        self.prediction[layer] = experts
        self.layer(layer).predicted += len(experts)

    def prefetched(self, layer: int, keys: list[int], nbytes: int) -> None:
        c = self.layer(layer)
        c.prefetched += len(keys)
        c.bytes_copied += len(keys) * nbytes
        self.prefetched_keys.update(keys)

    def step(self, layer: int, used: list[int], hits: list[int], copied: list[int], cpu: list[int],
             nbytes: int) -> None:
        c = self.layer(layer)
        c.hits += len(hits)
        c.misses += len(copied) + len(cpu)
        c.copied += len(copied)
        c.cpu_experts += len(cpu)
        c.bytes_copied += len(copied) * nbytes
        used_hits = self.prefetched_keys.intersection(hits)
        c.prefetch_hits += len(used_hits)
        self.prefetched_keys.difference_update(used_hits)
        self.prefetched_keys.difference_update(copied)
        predicted = self.prediction.pop(layer, None)
        if predicted is not None:
            c.predicted_used += len(predicted.intersection(used))
            c.used_when_predicted += len(used)

    def as_dict(self, resident: dict[int, int]) -> dict:
        per_layer = {str(k): _summary(asdict(v), resident.get(k, 0)) for k, v in sorted(self.layers.items())}
        total = LayerCounts()
        for v in self.layers.values():
            for name, value in asdict(v).items():
                setattr(total, name, getattr(total, name) + value)
        return {"total": _summary(asdict(total), sum(resident.values())), "per_layer": per_layer}


def _summary(c: dict, resident: int) -> dict:
    requests = c["hits"] + c["misses"]
    c["hit_rate"] = c["hits"] / requests if requests else 0.0
    c["resident"] = resident
    c["prefetch_accuracy"] = c["predicted_used"] / c["used_when_predicted"] if c["used_when_predicted"] else 0.0
    c["prefetch_precision"] = c["predicted_used"] / c["predicted"] if c["predicted"] else 0.0
    return c


def describe(tiers: dict) -> str:
    """The end-of-run summary `strata run` prints: totals, then one line per layer."""
    t = tiers["total"]
    lines = [f"[experts: {t['hit_rate']:.1%} hits ({t['hits']}/{t['hits'] + t['misses']}), "
             f"{t['copied']} copied in, {t['cpu_experts']} on the CPU, {t['resident']} resident, "
             f"{t['bytes_copied'] / 2**20:.1f} MiB copied, prefetch accuracy {t['prefetch_accuracy']:.1%}, "
             f"policy {tiers.get('policy')}]"]
    for home in tiers.get("homes", []):
        if home.get("home") == "disk":
            lines.append(f"[disk home: {home['bytes_read'] / 2**20:.1f} MiB read in {home['disk_reads']} reads "
                         f"({home.get('read_ahead', 0)} started ahead from predictions, "
                         f"{home.get('read_ahead_used', 0)} of them used, up to "
                         f"{home.get('max_reads_in_flight', 0)} in flight on {home.get('readers', 1)} readers, "
                         f"{home.get('read_wait_s', 0.0):.2f} s waited), "
                         f"RAM cache hit rate {home['ram_cache_hit_rate']:.1%}]")
    lines.append(f"  {'layer':>5} {'hits':>6} {'misses':>6} {'rate':>6} {'resident':>8} {'cpu':>6} {'prefetch':>8}")
    for layer, c in tiers["per_layer"].items():
        accuracy = f"{c['prefetch_accuracy']:.1%}" if c["used_when_predicted"] else "-"
        lines.append(f"  {layer:>5} {c['hits']:>6} {c['misses']:>6} {c['hit_rate']:>6.1%} {c['resident']:>8} "
                     f"{c['cpu_experts']:>6} {accuracy:>8}")
    return "\n".join(lines)
