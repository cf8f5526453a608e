"""Cache policies and the trace simulator: behaviour on crafted sequences, MIN's optimality."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from strata.cli import main as cli_main
from strata.errors import BadOption
from strata.tiers.cache_sim import Belady, parse_sizes, replay, replay_trace, simulate
from strata.tiers.policy import LRU, SlotMap, make_policy, regions
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
    path = perfectly_predicted_trace(tmp_path / "t.npz", n_tokens=100)
    png = tmp_path / "curves.png"
    assert cli_main(["cache-sim", str(path), "--policy", "lru,adaptive", "--sizes", "10%,50%",
                     "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "demand paging (no prefetch): overall hit rate" in out and "per layer at 50%" in out
    assert "adaptive / MIN" in out and "with prefetch" in out and "prefetch cost per token" in out
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


def test_prefetch_skips_admission_and_is_pinned_until_its_layer_runs():
    slots = SlotMap(regions(make_policy("adaptive", 2, 100)), n_experts=10)
    slots.request([0, 1], prefill=False)  # layer 0: both copied into the free slots
    slots.request([0, 1], prefill=False)
    assert [k for k, _ in slots.prefetch([11])] == [11]  # a never-used expert: admission would reject it
    assert [k for k, _ in slots.prefetch([21])] == [21]  # evicts layer 0's other expert, not the pinned 11
    assert slots.prefetch([31]) == [] and set(slots.where) == {11, 21}  # every slot pinned: nothing to evict
    hits, _, _ = slots.request([11], prefill=False)  # layer 1 runs: its prefetch was a hit, now unpinned
    assert hits == [11] and slots.pinned == {21}


def test_prefill_region_leaves_the_main_policy_alone():
    main = make_policy("adaptive", 2, 100)
    slots = SlotMap(regions(main, reserve=2), n_experts=10)
    slots.request([1, 2], prefill=False)
    scores = main.score.copy()
    for e in range(3, 9):
        slots.request([e], prefill=True)
        slots.prefetch([e + 1], prefill=True)
    assert main.resident == {1, 2} and np.array_equal(main.score, scores)
    assert len(slots.where) == 4


def perfectly_predicted_trace(path, n_tokens=200, n_layers=3, n_experts=16, k=2, seed=0):
    """Random routing with every next-layer prediction exactly right."""
    g = torch.Generator().manual_seed(seed)
    rec = TraceRecorder(n_experts)
    for t in range(n_tokens):
        ids = [torch.randperm(n_experts, generator=g)[:k][None] for _ in range(n_layers)]
        rec.next_step()
        for layer in range(n_layers):
            if layer + 1 < n_layers:
                rec.predicted(layer + 1, sorted(ids[layer + 1][0].tolist()))
            rec.record(layer, torch.tensor([t]), ids[layer], torch.full((1, k), 1.0 / k))
    return rec.save(path)


@pytest.mark.parametrize("policy", ["lru", "lfu", "adaptive"])
def test_exact_predictions_make_every_predicted_layer_hit(tmp_path, policy):
    trace = load_trace(perfectly_predicted_trace(tmp_path / "p.npz"))
    demand = replay_trace(trace, policy, slots=5, prefetch=False)
    prefetched = replay_trace(trace, policy, slots=5)
    assert prefetched.layer_rate(1) == prefetched.layer_rate(2) == 1.0 > demand.layer_rate(1)
    total = prefetched.total()
    assert total["prefetch_accuracy"] == 1.0 and total["prefetched"] > 0
    assert prefetched.layer_rate(0) <= demand.layer_rate(0) + 0.05  # layer 0 is never predicted


def test_version_1_traces_still_replay(tmp_path):
    new = load_trace(skewed_trace(tmp_path / "t.npz", n_tokens=50))
    np.savez_compressed(tmp_path / "v1.npz", step=new.step, layer=new.layer, tokens=new.tokens,
                        position=new.position, ids=new.ids, weights=new.weights, n_experts=np.int64(16),
                        meta=np.array("{}"))
    old = load_trace(tmp_path / "v1.npz")
    assert old.version == 1 and not old.has_predictions and old.prefill_flags() == [False] * 150
    a, b = simulate(old, ["adaptive"], [0.3]), simulate(new, ["adaptive"], [0.3])
    assert a["sizes"][0]["hit_rate"] == b["sizes"][0]["hit_rate"] and "prefetch" not in a["sizes"][0]
