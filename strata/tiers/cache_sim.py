"""`strata cache-sim`: replay an expert trace under cache policies, beside Belady's optimum.

The replay drives the runtime's own policy classes through the same `access` / `place`
calls, one request per (forward pass, layer), with the same global slot pool, so a
simulated hit rate is the one the engine would see. MIN evicts the resident expert whose
next use is farthest (Belady); it bounds what any policy without foresight can reach.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from dataclasses import dataclass, field

from strata.errors import BadOption
from strata.tiers.policy import Policy, half_life_tokens, make_policy
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

    def access(self, keys):
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
    hits: dict[int, int] = field(default_factory=dict)  # layer -> hits
    requests: dict[int, int] = field(default_factory=dict)  # layer -> requests

    @property
    def hit_rate(self) -> float:
        n = sum(self.requests.values())
        return sum(self.hits.values()) / n if n else 0.0

    def layer_rate(self, layer: int) -> float:
        n = self.requests.get(layer, 0)
        return self.hits.get(layer, 0) / n if n else 0.0


def replay(requests: list[tuple[int, list[int]]], policy: Policy, n_experts: int) -> SimResult:
    """Drive `policy` through the requests as the runtime does; count hits per layer."""
    result = SimResult()
    if getattr(policy, "preload", None):
        policy.place(list(policy.preload), set())
    for layer, experts in requests:
        keys = [layer * n_experts + e for e in experts]
        hits = sum(k in policy.resident for k in keys)
        policy.access(keys)
        policy.place([k for k in keys if k not in policy.resident], set(keys))
        result.hits[layer] = result.hits.get(layer, 0) + hits
        result.requests[layer] = result.requests.get(layer, 0) + len(keys)
    return result


def simulate(trace: Trace, policies, fractions) -> dict:
    """Hit rates of every policy and MIN at each cache size (a fraction of all experts)."""
    requests = trace.requests()
    layers = trace.layers
    n_keys = (max(layers) + 1) * trace.n_experts if layers else 0
    total = len(layers) * trace.n_experts
    keyed = [[layer * trace.n_experts + e for e in ex] for layer, ex in requests]
    ranking = _ranking(keyed)
    rows = []
    for frac in fractions:
        slots = max(int(round(frac * total)), 0)
        results = {name: replay(requests, _policy(name, slots, n_keys, trace, ranking), trace.n_experts)
                   for name in policies}
        results["min"] = replay(requests, Belady(slots, keyed), trace.n_experts)
        results["opt"] = replay(requests, Belady(slots, keyed, bypass=True), trace.n_experts)
        rows.append({"fraction": frac, "slots": slots,
                     "hit_rate": {n: r.hit_rate for n, r in results.items()},
                     "per_layer": {n: {layer: r.layer_rate(layer) for layer in layers} for n, r in results.items()}})
    return {"requests": len(requests), "layers": layers, "n_experts": trace.n_experts,
            "tokens": int(trace.tokens.sum()), "sizes": rows}


def _policy(name: str, slots: int, n_keys: int, trace: Trace, ranking: list[int]) -> Policy:
    """The runtime's policy with the runtime's settings (half-life from experts and top-k)."""
    k = trace.ids.shape[1] if trace.ids.ndim == 2 else 1
    return make_policy(name, slots, n_keys, n_layers=len(trace.layers),
                       ranking=ranking if name == "static" else None, half_life=half_life_tokens(trace.n_experts, k))


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
    lines = [f"{result['requests']} requests, {result['tokens']} token-routings, "
             f"{len(result['layers'])} layers x {result['n_experts']} experts",
             "static: the trace's most used experts, preloaded (hindsight); min: Belady, every miss "
             "copied in; opt: Belady free to leave a miss on the CPU",
             "", "overall hit rate", head]
    for row in result["sizes"]:
        rates = " ".join(f"{row['hit_rate'][c]:>9.1%}" for c in cols)
        lines.append(f"{row['fraction']:>6.0%} {row['slots']:>7} {rates}")
    if "adaptive" in policies:
        lines += ["", "adaptive / MIN: " + ", ".join(
            f"{row['fraction']:.0%}: {_ratio(row['hit_rate'])}" for row in result["sizes"])]
    for row in result["sizes"] if per_layer else []:
        lines += ["", f"per layer at {row['fraction']:.0%} ({row['slots']} slots)",
                  f"{'layer':>6} {'':>7} " + " ".join(f"{c:>9}" for c in cols)]
        for layer in result["layers"]:
            lines.append(f"{layer:>6} {'':>7} " + " ".join(f"{row['per_layer'][c][layer]:>9.1%}" for c in cols))
    return "\n".join(lines)


def _ratio(rates: dict) -> str:
    return f"{rates['adaptive'] / rates['min']:.1%}" if rates["min"] else "n/a"


def plot(result: dict, policies: list[str], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [row["fraction"] * 100 for row in result["sizes"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {"min": ("MIN (Belady)", "--"), "opt": ("MIN, misses may stay on CPU", ":")}
    for name in policies + ["min", "opt"]:
        label, style = labels.get(name, (name, "-"))
        ax.plot(xs, [row["hit_rate"][name] * 100 for row in result["sizes"]], marker="o", linestyle=style, label=label)
    ax.set_xlabel("cache size (% of all experts)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title(title or "expert cache hit rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata cache-sim", description="Replay an expert trace under cache policies.")
    p.add_argument("trace", help="a trace written by strata run --trace-experts")
    p.add_argument("--policy", default=",".join(ALL_POLICIES), help="comma list of lru,lfu,adaptive,static")
    p.add_argument("--sizes", default="10%,30%,50%,70%,90%", help="cache sizes, %% of all experts (default %(default)s)")
    p.add_argument("--plot", help="write the hit-rate curves to this image")
    p.add_argument("--summary-only", action="store_true", help="skip the per-layer tables")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    policies, fractions = parse_policies(args.policy), parse_sizes(args.sizes)
    result = simulate(load_trace(args.trace), policies, fractions)
    if args.json:
        json.dump(result, sys.stdout)
        print()
    else:
        print(table(result, policies, not args.summary_only))
    if args.plot:
        plot(result, policies, args.plot, f"expert cache: {args.trace}")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
