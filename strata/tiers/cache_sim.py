"""`strata cache-sim`: replay an expert trace under cache policies, beside Belady's optimum.

The replay drives the runtime's own policy classes through the same `access` / `place`
calls, one request per (forward pass, layer), with the same global slot pool, so a
simulated hit rate is the one the engine would see. MIN evicts the resident expert whose
next use is farthest (Belady) and copies every miss in; `opt` is Belady free to leave a miss
on the CPU, as an admitting policy may. `opt` bounds every policy here without foresight,
so ratios are quoted against it.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from dataclasses import dataclass, field

from strata.argparser import ArgumentParser
from strata.errors import BadOption
from strata.tiers.policy import Policy, SlotMap, make_policy, regions
from strata.tiers.stats import TierStats
from strata.tiers.trace import Trace, load_trace

ALL_POLICIES = ("lru", "lfu", "adaptive", "static")


class Belady(Policy):
    """Offline optimum: knows every request ahead; evicts the key used farthest in the future."""

    name = "min"

    def __init__(self, capacity: int, requests: list[list[int]], bypass: bool = False):
        super().__init__(capacity)
        self.bypass = bypass  # may leave a miss uncached (as admission can): the bound for such policies
        self.next_use = _next_uses(requests)  # per request: key -> index of its next request
        self.i = -1
        self.due: dict[int, float] = {}  # resident key -> next use
        self.heap: list[tuple[float, int]] = []  # (-next use, key), stale entries skipped
        self.uses: dict[int, int] = {}  # key -> requests that use it, in the whole trace
        for keys in requests:
            for k in keys:
                self.uses[k] = self.uses.get(k, 0) + 1

    def place(self, misses, protected, force=False, confidence=None):
        """A step's misses in order of next use (then of how often they recur), so that when a batched
        step brings more misses than there are slots, the free slots and evictions go to the soonest."""
        nxt = self.next_use[self.i] if self.i >= 0 else {}
        order = sorted(misses, key=lambda k: (nxt.get(k, math.inf), -self.uses.get(k, 0)))
        return super().place(order, protected, force, confidence)

    def access(self, keys, counts=None):
        self.i += 1
        for k in keys:
            if k in self.resident:
                self._schedule(k)

    def victim(self, protected):
        held, found = [], None
        while self.heap:
            due, k = self.heap[0]
            if k not in self.resident or self.due[k] != -due:
                heapq.heappop(self.heap)  # stale: evicted or rescheduled since
            elif k in protected:
                held.append(heapq.heappop(self.heap))  # in use this step: set aside
            else:
                found = k
                break
        for item in held:
            heapq.heappush(self.heap, item)
        return found

    def admit(self, key, victim):
        return not self.bypass or self.next_use[self.i].get(key, math.inf) < self.due[victim]

    def _insert(self, key):
        super()._insert(key)
        self._schedule(key)

    def _remove(self, key):
        super()._remove(key)
        self.due.pop(key, None)

    def _schedule(self, key):
        self.due[key] = self.next_use[self.i].get(key, math.inf)
        heapq.heappush(self.heap, (-self.due[key], key))


def _next_uses(requests: list[list[int]]) -> list[dict[int, float]]:
    seen: dict[int, float] = {}
    out: list[dict[int, float]] = [{} for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        for k in requests[i]:
            out[i][k] = seen.get(k, math.inf)
        for k in requests[i]:
            seen[k] = i
    return out


@dataclass(slots=True)
class SimResult:
    """The runtime's own counters (`TierStats`), filled by a replay instead of a model."""

    stats: TierStats = field(default_factory=TierStats)

    @property
    def hit_rate(self) -> float:
        return self.total()["hit_rate"]

    def layer_rate(self, layer: int) -> float:
        c = self.stats.layers.get(layer)
        return c.hits / (c.hits + c.misses) if c and c.hits + c.misses else 0.0

    def total(self) -> dict:
        return self.stats.as_dict({})["total"]


def replay(requests: list[tuple[int, list[int]]], policy: Policy, n_experts: int, prefill: list[bool] | None = None,
           predictions: dict | None = None, reserve: int = 0, expert_bytes=None,
           counts: list[list[int]] | None = None) -> SimResult:
    """Drive `policy` through the requests as the runtime does, through the runtime's `SlotMap`.

    `predictions` (record index -> [(layer, experts)]) are the prefetcher's guesses, issued
    before that record as the runtime issues them; `reserve` slots form the prefill region;
    `counts` (per record, aligned with its experts) the token-routings each expert served."""
    result = SimResult()
    slots = SlotMap(regions(policy, reserve), n_experts)
    unpaid = {k for k, _ in slots.preload()}  # a preloaded expert costs one copy, charged at its first use
    predictions = predictions or {}
    for i, (layer, experts) in enumerate(requests):
        in_prefill = bool(prefill[i]) if prefill else False  # a prediction shares its record's forward
        for p_layer, p_experts in predictions.get(i, ()):
            keys = [p_layer * n_experts + e for e in p_experts]
            result.stats.predicted(p_layer, set(keys))
            copies = slots.prefetch(keys, in_prefill)
            result.stats.prefetched(p_layer, [k for k, _ in copies], _nbytes(expert_bytes, p_layer))
        keys = [layer * n_experts + e for e in experts]
        hits, copies, cpu = slots.request(keys, in_prefill, counts[i] if counts else None)
        copied = [k for k, _ in copies]
        if unpaid:
            paid = unpaid.intersection(hits)
            hits, copied, unpaid = [k for k in hits if k not in paid], copied + sorted(paid), unpaid - paid
        result.stats.step(layer, keys, hits, copied, cpu, _nbytes(expert_bytes, layer))
    return result


def _nbytes(expert_bytes, layer: int) -> int:
    """Bytes of one expert of `layer`; 1 when the trace does not say (bytes then count copies)."""
    return (int(expert_bytes[layer]) or 1) if expert_bytes is not None and layer < len(expert_bytes) else 1


def replay_trace(trace: Trace, policy: str, slots: int, reserve: int = 0, prefetch: bool = True,
                 ranking: list[int] | None = None) -> SimResult:
    """What the runtime would count on this trace with `--cache-policy policy`, `slots` cache
    slots of which `reserve` are kept for prefill, and prefetch on or off."""
    requests = trace.requests()
    n_keys = (max(trace.layers) + 1) * trace.n_experts if trace.layers else 0
    if policy == "static" and ranking is None:
        ranking = _ranking([[layer * trace.n_experts + e for e in ex] for layer, ex in requests])
    return replay(requests, _policy(policy, slots - reserve, n_keys, trace, ranking), trace.n_experts,
                  trace.prefill_flags(), trace.predictions_by_record() if prefetch else None, reserve,
                  trace.expert_bytes, trace.request_counts())


def simulate(trace: Trace, policies, fractions, prefetch: bool = True, reserve: int = 0) -> dict:
    """Hit rates of every policy and MIN at each cache size (a fraction of all experts).

    `hit_rate`: demand paging (a miss is copied in, or left to the CPU, when it is used).
    `prefetch`: the same policies with the trace's next-layer predictions copied in ahead
    of use, as the runtime does with prefetch on (only for traces that recorded them).
    MIN and opt are demand-paging optima over all the slots: prefetch can beat them.
    `reserve` slots of each size are kept for prefill, as `--prefill-reserve` does."""
    requests = trace.requests()
    layers = trace.layers
    total = len(layers) * trace.n_experts
    keyed = [[layer * trace.n_experts + e for e in ex] for layer, ex in requests]
    ranking = _ranking(keyed)
    prefetch = prefetch and trace.has_predictions
    n_tokens = int(trace.tokens.sum()) // max(len(layers), 1)
    rows = []
    for frac in fractions:
        slots = max(int(frac * total), 0)  # as `--experts-cache N%` plans it, so the runtime sees this size
        if reserve > slots:
            raise BadOption(f"--prefill-reserve {reserve} is more than the {slots} slots of {frac:.0%}",
                            "use a smaller reserve or larger --sizes")

        def run(name, with_prefetch=False, slots=slots):
            return replay_trace(trace, name, slots, reserve, with_prefetch, ranking)

        results = {name: run(name) for name in policies}
        results["min"] = replay(requests, Belady(slots, keyed), trace.n_experts)
        results["opt"] = replay(requests, Belady(slots, keyed, bypass=True), trace.n_experts)
        row = {"fraction": frac, "slots": slots,
               "hit_rate": {n: r.hit_rate for n, r in results.items()},
               "per_layer": {n: {layer: r.layer_rate(layer) for layer in layers} for n, r in results.items()}}
        if prefetch:
            row["prefetch"] = {name: _prefetch_row(run(name, True), results[name], n_tokens)
                               for name in policies}
        rows.append(row)
    return {"requests": len(requests), "layers": layers, "n_experts": trace.n_experts,
            "tokens": int(trace.tokens.sum()), "n_tokens": n_tokens, "reserve": reserve, "trace_version": trace.version,
            "expert_bytes": trace.expert_bytes is not None and bool(trace.expert_bytes.any()),
            "predictions_from": trace.meta.get("predictions", "an unnamed predictor") if prefetch else None,
            "sizes": rows}


def _prefetch_row(with_prefetch: SimResult, demand: SimResult, n_tokens: int) -> dict:
    """With-prefetch figures, and what prefetch costs beside demand paging."""
    t, d = with_prefetch.total(), demand.total()
    return {"hit_rate": t["hit_rate"], "accuracy": t["prefetch_accuracy"], "precision": t["prefetch_precision"],
            "prefetched": t["prefetched"], "prefetch_used": t["prefetch_hits"],
            "copies_per_token": (t["copied"] + t["prefetched"]) / max(n_tokens, 1),
            "demand_copies_per_token": d["copied"] / max(n_tokens, 1),
            "bytes_per_token": t["bytes_copied"] / max(n_tokens, 1),
            "demand_bytes_per_token": d["bytes_copied"] / max(n_tokens, 1),
            "extra_bytes_per_token": (t["bytes_copied"] - d["bytes_copied"]) / max(n_tokens, 1)}


def _policy(name: str, slots: int, n_keys: int, trace: Trace, ranking: list[int]) -> Policy:
    """The runtime's policy with the runtime's settings."""
    return make_policy(name, slots, n_keys, n_experts=trace.n_experts, ranking=ranking if name == "static" else None)


def _ranking(keyed: list[list[int]]) -> list[int]:
    """The static baseline's hot set: the trace's most requested experts (hindsight)."""
    counts: dict[int, int] = {}
    for keys in keyed:
        for k in keys:
            counts[k] = counts.get(k, 0) + 1
    return sorted(counts, key=lambda k: -counts[k])


def parse_sizes(text: str) -> list[float]:
    out = []
    for part in str(text).split(","):
        part = part.strip().rstrip("%")
        try:
            value = float(part) / 100
        except ValueError:
            raise BadOption(f"--sizes {text!r}: {part!r} is not a percentage",
                            "write e.g. --sizes 10%,30%,50%") from None
        if not 0 <= value <= 1:
            raise BadOption(f"--sizes: {part}% is outside 0..100%")
        out.append(value)
    return out


def parse_policies(text: str) -> list[str]:
    names = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [p for p in names if p not in ALL_POLICIES]
    if bad or not names:
        raise BadOption(f"--policy: unknown policy {bad[0] if bad else text!r}",
                        f"choose from {','.join(ALL_POLICIES)}")
    return names


def table(result: dict, policies: list[str], per_layer: bool = True) -> str:
    cols = policies + ["min", "opt"]
    head = f"{'size':>6} {'slots':>7} " + " ".join(f"{c:>9}" for c in cols)
    lines = [(f"{result['requests']} requests, {result['tokens']} token-routings, "
             f"{len(result['layers'])} layers x {result['n_experts']} experts (trace format v{result['trace_version']})"),
             ("static: the trace's most used experts, preloaded (hindsight), each preloaded expert charged "
             "one miss at its first use; min: Belady, every miss copied in; opt: Belady free to leave a miss "
             "on the CPU (the bound quoted below); both are demand-paging optima"
             + (f"; policies keep {result['reserve']} slots for prefill" if result["reserve"] else "")),
             "", "demand paging (no prefetch): overall hit rate", head]
    for row in result["sizes"]:
        rates = " ".join(f"{row['hit_rate'][c]:>9.1%}" for c in cols)
        lines.append(f"{row['fraction']:>6.0%} {row['slots']:>7} {rates}")
    lines += ["", "demand paging, % of opt: " + "; ".join(
        f"{c} " + ", ".join(f"{row['fraction']:.0%}: {_ratio(row['hit_rate'][c], row['hit_rate'])}" for row in result["sizes"])
        for c in policies)]
    lines += _prefetch_lines(result, policies)
    for row in result["sizes"] if per_layer else []:
        lines += ["", f"demand paging, per layer at {row['fraction']:.0%} ({row['slots']} slots)",
                  f"{'layer':>6} {'':>7} " + " ".join(f"{c:>9}" for c in cols)]
        for layer in result["layers"]:
            lines.append(f"{layer:>6} {'':>7} " + " ".join(f"{row['per_layer'][c][layer]:>9.1%}" for c in cols))
    return "\n".join(lines)


def _prefetch_lines(result: dict, policies: list[str]) -> list[str]:
    """The with-prefetch table: hit rate and its ratio to MIN (demand paging), then prefetch's cost."""
    rows = [row for row in result["sizes"] if "prefetch" in row]
    if not rows:
        return ["", "with prefetch: n/a (this trace has no recorded predictions; record one with "
                "strata run --trace-experts, whose prefetcher writes them)"]
    unit = "MiB" if result["expert_bytes"] else "experts"
    scale = 2**20 if result["expert_bytes"] else 1
    lines = ["", (f"with prefetch (predictions recorded in the trace by {result['predictions_from']}; "
             "predicted misses copied in ahead of use): hit rate (/ opt's demand-paging hit rate)"),
             f"{'size':>6} {'slots':>7} " + " ".join(f"{c:>16}" for c in policies) + f" {'opt':>9}"]
    for row in rows:
        cells = " ".join(f"{row['prefetch'][c]['hit_rate']:>8.1%} ({_ratio(row['prefetch'][c]['hit_rate'], row['hit_rate'])})"
                         .rjust(16) for c in policies)
        lines.append(f"{row['fraction']:>6.0%} {row['slots']:>7} {cells} {row['hit_rate']['opt']:>9.1%}")
    lines += ["", (f"prefetch cost per token ({result['n_tokens']} tokens): prediction accuracy (used experts "
              f"predicted), copies and {unit} copied per token, prefetch off -> on"),
              f"{'size':>6} {'policy':>9} {'accuracy':>9} {'precision':>9} {'copies':>14} {unit:>18}"]
    for row in rows:
        for c in policies:
            p = row["prefetch"][c]
            copies = f"{p['demand_copies_per_token']:.2f} -> {p['copies_per_token']:.2f}"
            moved = f"{p['demand_bytes_per_token'] / scale:.3f} -> {p['bytes_per_token'] / scale:.3f}"
            lines.append(f"{row['fraction']:>6.0%} {c:>9} {p['accuracy']:>9.1%} {p['precision']:>9.1%} "
                         f"{copies:>14} {moved:>18}")
    return lines


def _ratio(rate: float, rates: dict) -> str:
    return f"{rate / rates['opt']:.1%}" if rates["opt"] else "n/a"


def plot(result: dict, policies: list[str], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [row["fraction"] * 100 for row in result["sizes"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"min": ("MIN (Belady, demand paging)", "--"), "opt": ("MIN, misses may stay on CPU", ":")}
    for name in policies + ["min", "opt"]:
        label, style = labels.get(name, (f"{name} (demand)", "-"))
        line, = ax.plot(xs, [row["hit_rate"][name] * 100 for row in result["sizes"]], marker="o",
                        linestyle=style, label=label)
        if name in policies and name != "static" and all("prefetch" in row for row in result["sizes"]):
            ax.plot(xs, [row["prefetch"][name]["hit_rate"] * 100 for row in result["sizes"]], marker="^",
                    linestyle="-.", color=line.get_color(), label=f"{name} + prefetch")
    ax.set_xlabel("cache size (% of all experts)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(title or "expert cache hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="strata cache-sim", description="Replay an expert trace under cache policies.")
    p.add_argument("trace", help="a trace written by strata run --trace-experts")
    p.add_argument("--policy", default=",".join(ALL_POLICIES), help="comma list of lru,lfu,adaptive,static")
    p.add_argument("--sizes", default="10%,30%,50%,70%,90%", help="cache sizes, %% of all experts (default %(default)s)")
    p.add_argument("--prefill-reserve", type=int, default=0, metavar="N",
                   help="slots of each size kept for prefill, as strata run --prefill-reserve")
    p.add_argument("--plot", help="write the hit-rate curves to this image")
    p.add_argument("--summary-only", action="store_true", help="skip the per-layer tables")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    policies, fractions = parse_policies(args.policy), parse_sizes(args.sizes)
    if args.prefill_reserve < 0:
        raise BadOption(f"--prefill-reserve {args.prefill_reserve} is negative", "give 0 or more slots")
    result = simulate(load_trace(args.trace), policies, fractions, reserve=args.prefill_reserve)
    if args.json:
        json.dump(result, sys.stdout)
        print()
    else:
        print(table(result, policies, not args.summary_only))
    if args.plot:
        plot(result, policies, args.plot, f"expert cache: {args.trace}")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
