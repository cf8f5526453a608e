"""Cache policies and the trace simulator: behaviour on crafted sequences, MIN's optimality."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from strata.cli import main as cli_main
from strata.errors import BadOption
from strata.tiers.cache_sim import Belady, parse_sizes, replay, simulate
from strata.tiers.policy import LRU, make_policy
from strata.tiers.trace import TraceRecorder, load_trace


def run(policy, requests):
    """Replay single-layer requests (lists of experts); return the hit count."""
    result = replay([(0, r) for r in requests], policy, 1000)
    return result.stats.layers[0].hits if requests else 0


def test_lru_evicts_the_least_recent_and_never_a_key_in_use():
    lru = LRU(2)
    for keys in ([1], [2], [1], [3]):
        lru.access(keys)
        lru.place([k for k in keys if k not in lru.resident], set(keys))
    assert lru.resident == {1, 3}
    admitted, rejected = lru.place([4, 5], {1, 3, 4, 5})
    assert admitted == [] and rejected == [4, 5]


def test_adaptive_keeps_a_hot_set_through_a_scan():
    hot = [[1], [2]] * 20
    scan = [[100 + i] for i in range(30)]
    requests = hot + scan + hot
    adaptive, lru = make_policy("adaptive", 2, 1000), make_policy("lru", 2, 1000)
    assert run(adaptive, requests) > run(lru, requests)
    assert adaptive.resident == {1, 2}


def test_adaptive_learns_a_new_hot_set():
    old, new = [[1], [2]] * 30, [[7], [8]] * 400
    adaptive = make_policy("adaptive", 2, 1000, half_life=16)
    run(adaptive, old + new)
    assert adaptive.resident == {7, 8}


def test_static_never_changes_after_filling():
    static = make_policy("static", 2, 1000, ranking=[5, 6, 7])
    assert static.preload == [5, 6]
    run(static, [[1], [2], [3]])
    assert static.resident == {5, 6}


def optimal_hits(requests: list[int], capacity: int, bypass: bool = False) -> int:
    """Exhaustive search over every eviction choice (and, with bypass, not caching at all)."""

    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(requests):
            return 0
        k = requests[i]
        if k in cache:
            return 1 + best(i + 1, cache)
        if len(cache) < capacity:
            return best(i + 1, cache | {k})
        keep = [best(i + 1, cache)] if bypass else []
        return max([best(i + 1, (cache - {v}) | {k}) for v in cache] + keep)

    return best(0, frozenset())


@pytest.mark.parametrize("bypass", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_belady_is_optimal(seed, bypass):
    rng = random.Random(seed)
    capacity = rng.choice([1, 2, 3])
    requests = [rng.randrange(6) for _ in range(14)]
    belady = Belady(capacity, [[k] for k in requests], bypass=bypass)
    assert run(belady, [[k] for k in requests]) == optimal_hits(requests, capacity, bypass)


def skewed_trace(path, n_tokens=300, n_layers=3, n_experts=16, k=2, seed=0):
    """Zipf-like routing that drifts halfway: a hot set, then another."""
    g = torch.Generator().manual_seed(seed)
    rec = TraceRecorder(n_experts)
    probs = 1.0 / torch.arange(1, n_experts + 1).float() ** 1.2
    for t in range(n_tokens):
        rec.next_step()
        perm = torch.arange(n_experts) if t < n_tokens // 2 else torch.arange(n_experts).flip(0)
        for layer in range(n_layers):
            ids = perm[torch.multinomial(probs, k, generator=g)][None]
            rec.record(layer, torch.tensor([t]), ids, torch.full((1, k), 1.0 / k))
    return rec.save(path)


def test_min_bounds_every_policy(tmp_path):
    trace = load_trace(skewed_trace(tmp_path / "t.npz"))
    result = simulate(trace, ["lru", "lfu", "adaptive", "static"], [0.1, 0.3, 0.7])
    for row in result["sizes"]:
        rates = row["hit_rate"]
        assert all(rates[p] <= rates["opt"] + 1e-9 for p in ("lru", "lfu", "adaptive", "static", "min")), rates
        assert all(rates[p] <= rates["min"] + 1e-9 for p in ("lru", "lfu")), rates  # they copy every miss in
        for layer in result["layers"]:
            assert 0 <= row["per_layer"]["adaptive"][layer] <= 1
    assert result["sizes"][-1]["hit_rate"]["min"] > result["sizes"][0]["hit_rate"]["min"]


def test_trace_round_trip(tmp_path):
    path = skewed_trace(tmp_path / "t", n_tokens=5)
    assert path.name == "t.npz"
    trace = load_trace(path)
    assert trace.layers == [0, 1, 2] and trace.n_experts == 16
    assert trace.position.tolist() == [t for t in range(5) for _ in range(3)]
    assert len(trace.requests()) == 15 and trace.weights.dtype == np.float16


def test_cache_sim_command_prints_and_plots(tmp_path, capsys):
    path = skewed_trace(tmp_path / "t.npz", n_tokens=100)
    png = tmp_path / "curves.png"
    assert cli_main(["cache-sim", str(path), "--policy", "lru,adaptive", "--sizes", "10%,50%",
                     "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "overall hit rate" in out and "min" in out and "per layer at 50%" in out
    assert "adaptive / MIN" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,flag", [(["--sizes", "ten"], "--sizes"), (["--sizes", "150%"], "--sizes"),
                                       (["--policy", "fifo"], "--policy")])
def test_cache_sim_bad_input(tmp_path, capsys, argv, flag):
    path = skewed_trace(tmp_path / "t.npz", n_tokens=3)
    assert cli_main(["cache-sim", str(path), *argv]) == 2
    assert flag in capsys.readouterr().err


def test_not_a_trace(tmp_path, capsys):
    (tmp_path / "x.npz").write_bytes(b"nope")
    assert cli_main(["cache-sim", str(tmp_path / "x.npz")]) == 2
    assert "not an expert trace" in capsys.readouterr().err


def test_parse_sizes():
    assert parse_sizes("10%,30, 90%") == [0.1, 0.3, 0.9]
    with pytest.raises(BadOption):
        parse_sizes("")
