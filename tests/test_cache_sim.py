"""Cache policies and the trace simulator: behaviour on crafted sequences, MIN's optimality."""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch

from strata.cli import main as cli_main
from strata.errors import BadOption, StrataError
from strata.tiers.cache_sim import Belady, parse_sizes, replay, replay_trace, simulate, table
from strata.tiers.policy import LRU, Adaptive, SlotMap, make_policy, regions
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
    """One-off experts for ten times the hot set's reuse gap do not displace it (LRU's do)."""
    hot = [[1], [2]] * 20
    scan = [[100 + i] for i in range(20)]
    requests = hot + scan + hot
    adaptive, lru = make_policy("adaptive", 2, 1000), make_policy("lru", 2, 1000)
    assert run(adaptive, requests) > run(lru, requests)
    assert adaptive.resident == {1, 2}


def test_adaptive_learns_a_new_hot_set():
    old, new = [[1], [2]] * 30, [[7], [8]] * 400
    adaptive = make_policy("adaptive", 2, 1000)
    run(adaptive, old + new)
    assert adaptive.resident == {7, 8}


def test_adaptive_ranks_a_key_in_a_burst_above_a_one_off_of_the_same_cell():
    """Two keys with the same lag and lifetime share: the one used in each of the last runs
    outranks the one used once, after routing in which bursts were what got reused."""
    E, burst, one_off = 8, 0, 1

    def block():  # each key bursts for 6 runs beside one-off keys: 12 uses a key
        return [[b, (b + 1 + t) % E] for b in range(E) for t in range(6)]

    runs = block() * 3 + [[one_off, 5], [one_off, 6], [one_off, 7]] + block() * 3
    runs += [[burst, 2], [burst, 3], [burst, 4], [burst, one_off]]
    adaptive = make_policy("adaptive", 2, E)
    for keys in runs:
        adaptive.access(keys)
    keys = np.array([burst, one_off])
    lag, share, _, _ = adaptive._cells(keys)
    assert lag[0] == lag[1] and share[0] == share[1]  # one cell of the table: only the calibration tells them apart
    high, low = adaptive.estimate(keys)
    assert high > low + 0.01
    adaptive.place([burst, one_off], set())
    assert adaptive.victim(set()) == one_off


def test_adaptive_calibrates_each_layer_to_its_own_reuse():
    """Two layers of 4 experts routed uniformly, one top-2 and one top-1: each expert gets the same
    lifetime share (1/E) in both, but is used at the next run with chance 1/2 in the first and 1/4
    in the second. The shared calibration alone puts both near the middle (0.40 and 0.35); each
    layer's own offset brings them to their rates."""
    E, rng = 4, np.random.default_rng(0)
    adaptive = make_policy("adaptive", 4, 2 * E, n_experts=E)
    seen = {0: [], 1: []}
    for run_ in range(600):
        for layer, top in ((0, 2), (1, 1)):
            if run_ >= 300:
                seen[layer].append(adaptive.estimate(np.arange(layer * E, (layer + 1) * E)).mean())
            adaptive.access([layer * E + int(e) for e in rng.choice(E, top, replace=False)])
    assert abs(np.mean(seen[0]) - 0.5) < 0.03 and abs(np.mean(seen[1]) - 0.25) < 0.03


def test_adaptive_learns_which_experts_follow_which_at_a_layer():
    """Decode routing where expert a is followed by a+1 or a+3 (of 8), each half the time: every
    expert has the same lifetime share and the same spread of lags, so only what followed what
    tells the two successors of the last expert from the other six. A batched step, which does
    not say which token used which expert, leaves no such score."""
    E, rng = 8, np.random.default_rng(0)
    adaptive = make_policy("adaptive", 4, E, n_experts=E)
    expert = 0
    for _ in range(400):
        adaptive.access([expert])
        expert = (expert + int(rng.choice([1, 3]))) % E
    last = int(np.flatnonzero(adaptive.last == adaptive.runs[0])[0])
    after = [(last + 1) % E, (last + 3) % E]
    chance = adaptive.estimate_following(np.arange(E))
    assert chance[after].min() > 0.3 and np.delete(chance, after).max() < 0.1
    assert np.delete(adaptive.estimate(np.arange(E)), after).max() > 0.1  # the calibration without the input
    adaptive.access([1, 2, 5], counts=[9, 7, 8])  # a batched step
    assert not adaptive.follows.any()


class _WithoutInput(Adaptive):
    """Adaptive that never ranks with the transition input."""

    following = property(lambda self: False, lambda self, value: None)


def _successor_pairs(n: int, seed: int = 0) -> list[list[int]]:
    """Top-2 routing of 8 experts in which each pair has a successor pair, taken 80 % of the time."""
    rng, succ, pair, out = np.random.default_rng(seed), {}, (0, 1), []
    for _ in range(n):
        out.append(sorted(pair))
        if tuple(out[-1]) not in succ:
            succ[tuple(out[-1])] = tuple(int(x) for x in rng.choice(8, 2, replace=False))
        pair = succ[tuple(out[-1])] if rng.random() < 0.8 else tuple(int(x) for x in rng.choice(8, 2, replace=False))
    return out


@pytest.mark.parametrize("slots", [2, 3])
def test_adaptive_ranks_with_the_transition_input_while_its_shadow_cache_hits_more(slots):
    """Two shadow resident sets, ranked with and without what-follows-what, take every run's keys;
    the cache ranks with the input while its shadow has hit more lately. Where each pair of experts
    has a usual successor, the input pays and the cache follows it; the same routing as batched steps
    (which score no transitions) ranks alike in both shadows, so the cache decides as without it."""
    routing = [(0, keys) for keys in _successor_pairs(800)]
    adaptive, without = make_policy("adaptive", slots, 8, n_experts=8), _WithoutInput(slots, 8, 8)
    rate, rate_without = replay(routing, adaptive, 8).hit_rate, replay(routing, without, 8).hit_rate
    assert adaptive.following and rate > rate_without + 0.05
    batched = [[2, 2]] * len(routing)
    adaptive, without = make_policy("adaptive", slots, 8, n_experts=8), _WithoutInput(slots, 8, 8)
    rate, rate_without = replay(routing, adaptive, 8, counts=batched), replay(routing, without, 8, counts=batched)
    assert not adaptive.following and not adaptive.lead
    assert rate.stats.layers[0].hits == rate_without.stats.layers[0].hits


class _WithoutLFUDuel(Adaptive):
    """Adaptive that never moves towards its LFU shadow's contents (the policy before the LFU duel)."""

    following_lfu = property(lambda self: False, lambda self, value: None)


def _zipf_top2(n: int, n_experts: int = 32, skew: float = 1.2, seed: int = 0) -> list[list[int]]:
    """Stationary top-2 routing, expert i drawn with weight 1 / (i + 1) ** skew: long-run counts are all there is."""
    rng = np.random.default_rng(seed)
    weights = 1 / np.arange(1, n_experts + 1) ** skew
    return [sorted(rng.choice(n_experts, 2, replace=False, p=weights / weights.sum()).tolist()) for _ in range(n)]


@pytest.mark.parametrize("slots", [16, 24])
def test_adaptive_moves_to_its_lfu_shadow_while_lfu_hits_more(slots):
    """On stationary routing with room for half or more of the experts, keeping the most-used is what
    pays (the demo's 70 % cell); the next-run chance ranks a just-used rare expert above a steady one
    that has not been used for a few runs, and so hits less than LFU. A third shadow kept by LFU is
    duelled against the adaptive one on one-token runs; while it leads, the cache evicts what it does
    not hold. The cache then follows it and closes most of the gap to LFU; as batched steps (which the
    duel does not score) the same routing decides as without it."""
    routing = [(0, keys) for keys in _zipf_top2(1500)]
    hits = {}
    for name, policy in (("adaptive", make_policy("adaptive", slots, 32, n_experts=32)),
                         ("without", _WithoutLFUDuel(slots, 32, 32)), ("lfu", make_policy("lfu", slots, 32))):
        hits[name] = replay(routing, policy, 32).stats.layers[0].hits
        if name == "adaptive":
            assert policy.following_lfu
    assert hits["without"] + 10 < hits["adaptive"]  # 2556 -> 2575 at 16 slots, 2797 -> 2810 at 24 (LFU 2582, 2814)
    assert hits["lfu"] - hits["adaptive"] < (hits["lfu"] - hits["without"]) / 2
    batched = [[2, 2]] * len(routing)
    adaptive = make_policy("adaptive", slots, 32, n_experts=32)
    rate = replay(routing, adaptive, 32, counts=batched)
    assert not adaptive.following_lfu and not adaptive.lfu_lead
    assert rate.stats.layers[0].hits == replay(routing, _WithoutLFUDuel(slots, 32, 32), 32, counts=batched).stats.layers[0].hits


def test_adaptive_evicts_a_key_of_the_layer_that_just_ran_before_one_of_a_layer_still_to_run():
    """The cache sees a step's layers in order: a key of the layer that just ran waits a whole step
    for its next chance, one of a later layer may be used in this very step. So the first is
    evicted even at a slightly higher chance of use at its layer's next run."""
    E = 4
    adaptive = make_policy("adaptive", 3, 4 * E, n_experts=E)
    for layer in range(3):  # one step over layers 0-2, each using its expert 0
        adaptive.access([layer * E])
        adaptive.place([layer * E], {layer * E})
    adaptive.access([1])  # the next step's layer 0 uses expert 1
    chance = {0: 0.31, E: 0.30, 2 * E: 0.30, 1: 0.30}
    adaptive.estimate = lambda keys: np.array([chance[int(k)] for k in keys])
    assert adaptive.victim({1}) == 0


def test_adaptive_decides_alike_whatever_layers_its_keys_cover_beyond_those_that_run():
    """The runtime sizes the key space by the model's expert layers (a draft layer that a plain
    decode never runs included), the simulator by the trace's: the same routing must give the
    same decisions, or the runtime's hit rate is not cache-sim's."""
    E, rng = 8, np.random.default_rng(0)
    steps = [[sorted(set((layer * E + rng.integers(0, E, 2)).tolist())) for layer in range(4)] for _ in range(60)]
    placed = []
    for n_layers in (4, 5):
        slots = SlotMap(regions(make_policy("adaptive", 9, n_layers * E, n_experts=E)), n_experts=E)
        placed.append([slots.request(keys, prefill=False) for step in steps for keys in step])
    assert placed[0] == placed[1]


def test_a_step_scores_the_resident_set_once_however_many_misses_it_places():
    """Ranks change only when a layer runs, so placing a batched step's misses scores the residents
    once (not once per miss, which made a wide step's placement cost misses x residents)."""
    adaptive = make_policy("adaptive", 40, 1000)
    for i in range(40):
        adaptive.access([i])
        adaptive.place([i], {i})
    sizes, ranks = [], adaptive.ranks
    adaptive.ranks = lambda keys: sizes.append(len(keys)) or ranks(keys)
    misses = list(range(100, 110))
    adaptive.access(misses)
    admitted, rejected = adaptive.place(misses, set(misses))
    assert len(admitted) + len(rejected) == 10 and len(admitted) > 0
    assert sizes.count(40) == 1 and max(sizes[1:]) == 1


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
    assert "% of opt: lru 10%:" in out and "with prefetch" in out and "prefetch cost per token" in out
    assert "predictions recorded in the trace by a test's exact predictor" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_trace_found_without_its_suffix(tmp_path, capsys):
    """`--trace-experts t` writes t.npz; `strata cache-sim t` reads it."""
    skewed_trace(tmp_path / "t", n_tokens=20)
    assert not (tmp_path / "t").exists()
    assert cli_main(["cache-sim", str(tmp_path / "t"), "--sizes", "30%", "--summary-only"]) == 0
    assert "60 requests" in capsys.readouterr().out
    assert cli_main(["cache-sim", str(tmp_path / "missing")]) == 2
    assert "no such trace" in capsys.readouterr().err


def test_ratios_are_to_opt_and_never_exceed_it(tmp_path):
    """opt (misses may stay on the CPU) is the headline bound: no policy's % of it passes 100 %."""
    trace = load_trace(batched_trace(tmp_path / "b.npz"))
    result = simulate(trace, ["lru", "lfu", "adaptive", "static"], [0.1, 0.3, 0.5])
    text = table(result, ["lru", "lfu", "adaptive", "static"], per_layer=False)
    assert "% of opt" in text and "/ MIN" not in text
    for row in result["sizes"]:
        rates = row["hit_rate"]
        assert all(rates[p] <= rates["opt"] + 1e-9 for p in ("lru", "lfu", "adaptive", "static", "min"))
    assert any(row["hit_rate"]["adaptive"] > row["hit_rate"]["min"] for row in result["sizes"])  # MIN is no bound


def test_static_pays_for_its_preload(tmp_path):
    """Each preloaded expert costs one miss at its first use, so hindsight cannot beat opt."""
    trace = load_trace(skewed_trace(tmp_path / "t.npz", n_tokens=40))
    slots = 10
    result = replay_trace(trace, "static", slots, prefetch=False).total()
    keys = [layer * trace.n_experts + e for layer, ex in trace.requests() for e in ex]
    top = sorted(set(keys), key=lambda k: -keys.count(k))[:slots]
    assert result["copied"] == len(set(top) & set(keys)) == slots  # every preloaded one was used once at least
    assert result["hits"] == sum(1 for k in keys if k in top) - slots
    row = simulate(trace, ["static"], [slots / (3 * 16)])["sizes"][0]["hit_rate"]
    assert row["static"] <= row["opt"] + 1e-9


def batched_trace(path, n_steps=60, batch=12, n_experts=16, k=2, seed=1):
    """Batched decode: each forward routes `batch` tokens per layer, so a layer uses most experts."""
    g = torch.Generator().manual_seed(seed)
    rec = TraceRecorder(n_experts)
    probs = 1.0 / torch.arange(1, n_experts + 1).float() ** 0.8
    for t in range(n_steps):
        rec.next_step()
        for layer in range(2):
            ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(batch)])
            rec.record(layer, torch.arange(batch), ids, torch.full((batch, k), 1.0 / k))
    return rec.save(path)


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
    slots.request([0, 1], prefill=False)  # layer 0: both copied into the free slots, valued at the prior 0.2
    assert [k for k, _ in slots.prefetch([11])] == [11]  # a never-used expert: admission would reject it
    assert [k for k, _ in slots.prefetch([21])] == [21]  # evicts layer 0's other expert, not the pinned 11
    assert slots.prefetch([31]) == [] and set(slots.where) == {11, 21}  # every slot pinned: nothing to evict
    hits, _, _ = slots.request([11], prefill=False)  # layer 1 runs: its prefetch was a hit, now unpinned
    assert hits == [11] and slots.pinned == {21}


def test_prefill_region_leaves_the_main_policy_alone():
    main = make_policy("adaptive", 2, 100)
    slots = SlotMap(regions(main, reserve=2), n_experts=10)
    slots.request([1, 2], prefill=False)
    state = (main.runs.copy(), main.routed.copy(), main.seen.copy())
    for e in range(3, 9):
        slots.request([e], prefill=True)
        slots.prefetch([e + 1], prefill=True)
    assert main.resident == {1, 2}
    assert all(np.array_equal(a, b) for a, b in zip(state, (main.runs, main.routed, main.seen)))
    assert len(slots.where) == 4


def test_adaptive_weighs_a_batched_step_by_the_tokens_each_expert_served():
    """Two experts used in every batched step, one by 20 tokens, one by 1: the rarer is the victim;
    counted once per step each (no counts), they tie and the first placed goes."""
    for counts, victim in (([20, 1], 2), (None, 1)):
        main = make_policy("adaptive", 2, 10)
        slots = SlotMap(regions(main), n_experts=10)
        for _ in range(5):
            slots.request([1, 2], prefill=False, counts=counts)
        assert main.victim(set()) == victim


def perfectly_predicted_trace(path, n_tokens=200, n_layers=3, n_experts=16, k=2, seed=0):
    """Random routing with every next-layer prediction exactly right."""
    g = torch.Generator().manual_seed(seed)
    rec = TraceRecorder(n_experts)
    for t in range(n_tokens):
        ids = [torch.randperm(n_experts, generator=g)[:k][None] for _ in range(n_layers)]
        rec.next_step()
        for layer in range(n_layers):
            if layer + 1 < n_layers:
                rec.predicted(layer + 1, sorted(ids[layer + 1][0].tolist()), "a test's exact predictor")
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


def test_a_prefetch_evicts_only_what_the_policy_values_below_the_prediction():
    """Predictions for layer 1 that are never used lose their confidence; then a prefetch no longer
    evicts layer 0's experts, which are used every run (the policy values them near 1)."""
    slots = SlotMap(regions(make_policy("adaptive", 2, 100)), n_experts=10)
    for _ in range(12):
        slots.request([0, 1], prefill=False)  # layer 0: experts 0 and 1, every run
        slots.prefetch([19])  # predicted for layer 1 ...
        slots.request([11], prefill=False)  # ... which uses expert 1 instead: a CPU miss
    before = dict(slots.where)
    assert slots.confidence(1) < 0.1 and len(before) == 2
    assert slots.prefetch([18]) == [] and slots.where == before  # every resident is worth more than 7 %
    right = SlotMap(regions(make_policy("adaptive", 2, 100)), n_experts=10)
    for _ in range(12):
        right.request([0, 1], prefill=False)
        right.prefetch([11])  # right every time: confidence near 1, above what expert 0 or 1 is worth
        right.request([11], prefill=False)
    assert right.confidence(1) > 0.9 and 11 in right.where


def test_a_prefetch_for_the_next_layer_may_evict_a_likelier_key_of_the_layer_that_just_ran():
    """Expert 0 is used at every run of layer 0, but layer 0 has just run: its next use is a step
    away. A prediction for layer 1, right 7 times in 8, is needed now, so its expected wait is
    shorter and it may take the slot; the same prediction right once in 8 may not."""
    for right, evicted in ((7, True), (1, False)):
        policy = make_policy("adaptive", 3, 80, n_experts=10)
        slots = SlotMap(regions(policy), n_experts=10)
        for step in range(24):  # a step of 8 layers: 0, 1, then 7 (the others dense)
            slots.request([0], prefill=False)
            slots.prefetch([11])
            slots.request([11] if step % 8 < right else [13], prefill=False)
            slots.request([70], prefill=False)
        slots.request([0], prefill=False)
        assert policy.estimate(np.array([0]))[0] > slots.confidence(1)
        assert (slots.prefetch([12]) == [(12, slots.where.get(12))]) == evicted
        assert (0 in slots.where) != evicted


def _converter():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "convert_routing_log.py"
    spec = importlib.util.spec_from_file_location("convert_routing_log", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_converter_reads_decode_logs_per_token(tmp_path):
    """speculative-moe layout (Mixtral, decode tokens): one forward per (problem, token), layers in order."""
    import json

    rows = [{"dataset": "humaneval", "problem_id": p, "layer": layer, "experts": [(t + layer) % 8, (t + 3) % 8],
             "gating_probs": [0.6, 0.4], "token_idx": t} for p in range(2) for layer in range(4) for t in range(5)]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows))  # grouped by layer, as the public files are
    info = _converter().convert([log], tmp_path / "m")
    trace = load_trace(tmp_path / "m")
    assert info["decode_tokens"] == 10 and info["prefill_tokens"] == 0 and trace.n_experts == 8
    assert trace.layer.tolist()[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert trace.ids[1].tolist() == [1, 3] and trace.expert_bytes[0] > 0  # token 0, layer 1


def test_converter_predicts_the_next_layer_from_earlier_forwards_only(tmp_path):
    """--predict: layer 1's experts follow layer 0's by a fixed rule; the first forward has nothing to
    learn from, so no prediction; later ones name exactly what layer 1 uses, before its record."""
    import json

    rows = [{"dataset": "gsm8k", "problem_id": 0, "layer": layer, "token_idx": t, "gating_probs": [0.5, 0.5],
             "experts": [t % 4, 4 + t % 4] if layer == 0 else [(t + 1) % 4, 4 + (t + 2) % 4]}
            for layer in range(2) for t in range(12)]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in rows))
    info = _converter().convert([log], tmp_path / "p", predict=True)
    trace = load_trace(tmp_path / "p")
    by_record = trace.predictions_by_record()
    assert info["predictions"] == len(trace.predictions) == 8  # tokens 4..11: each rule seen once before
    assert min(by_record) == 9 and all(layer == 1 for p in by_record.values() for layer, _ in p)
    for record, preds in by_record.items():
        assert preds[0][1] == sorted(set(trace.ids[record].tolist()))  # record `record` is layer 1's
    assert "co-occurrence" in trace.meta["predictions"]


def test_converter_merges_per_layer_logger_files(tmp_path):
    """vllm-moe-logger layout: profiling forwards dropped, wide forwards marked prefill, layers merged."""
    import json

    def log(layer, path):
        lines = [{"type": "meta", "model_id": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "layers_logged": [layer], "top_k": 4}]
        forwards = [[[1, 2, 3, 4]] * 16] + [[[t % 60, 5, 6, 7 + t] for t in range(9)]] + [[[t, 9, 10, 11 + layer]
                                                                                         for t in range(3)]] * 4
        for fwd in forwards:
            lines += [{"type": "route", "req_id": "r1", "token_idx": i, "layer": layer, "topk_ids": ids,
                       "topk_weights": [0.1] * 4} for i, ids in enumerate(fwd)]
        path.write_text("\n".join(json.dumps(x) for x in lines))
        return path

    info = _converter().convert([log(0, tmp_path / "a.jsonl"), log(8, tmp_path / "b.jsonl")], tmp_path / "q.npz")
    trace = load_trace(tmp_path / "q.npz")
    assert info["forwards"] == 5 and info["prefill_tokens"] == 9 and info["decode_tokens"] == 12
    assert trace.layers == [0, 8] and trace.n_experts == 60 and trace.prefill_flags()[:2] == [True, True]
    assert trace.ids[-1].tolist() == [2, 9, 10, 19]
    short = tmp_path / "c.jsonl"
    short.write_text("\n".join(short_line for short_line in (tmp_path / "a.jsonl").read_text().splitlines()[:-1]))
    with pytest.raises(StrataError, match="differ in size"):
        _converter().convert([tmp_path / "a.jsonl", short], tmp_path / "bad.npz")


def test_converter_splits_a_log_with_one_token_counter_by_forward_sizes(tmp_path):
    """A logger whose token_idx never restarts (OLMoE's): the forwards come from --forward-sizes, the
    profiling forward is still dropped, and a decode batch that shrinks by one stays decode."""
    import json

    sizes = [16, 9, 3, 3, 2, 2, 2]
    ids = [[1, 2]] * 16 + [[t % 64, 63 - t % 64] for t in range(sum(sizes) - 16)]
    lines = [{"type": "meta", "model_id": "allenai/OLMoE-1B-7B-0924", "layers_logged": [0], "top_k": 2}]
    lines += [{"type": "route", "req_id": "r0", "token_idx": i, "layer": 0, "topk_ids": x, "topk_weights": [0.5, 0.5]}
              for i, x in enumerate(ids)]
    log = tmp_path / "olmoe.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines))
    conv = _converter()
    with pytest.raises(StrataError, match="never restarts"):
        conv.convert([log], tmp_path / "x.npz")
    assert conv.parse_forward_sizes("16,9,3*2,2*3") == sizes
    with pytest.raises(StrataError, match="add up to"):
        conv.convert([log], tmp_path / "x.npz", forward_sizes=[16, 9, 3])
    info = conv.convert([log], tmp_path / "o.npz", forward_sizes=sizes)
    trace = load_trace(tmp_path / "o.npz")
    assert info["forwards"] == 6 and info["prefill_tokens"] == 9 and info["decode_tokens"] == 12
    assert trace.n_experts == 64 and trace.prefill_flags()[:2] == [True, False] and trace.expert_bytes[0] > 0


def test_opt_fills_a_batched_step_with_the_soonest_reused():
    """A step with more misses than slots: opt keeps those used next, so hindsight's preload cannot beat it."""
    requests = [[1, 2, 3, 4]] + [[3, 4, 10 + i] for i in range(8)]
    static = replay([(0, r) for r in requests], make_policy("static", 2, 1000, ranking=[3, 4]), 1000).total()
    opt = replay([(0, r) for r in requests], Belady(2, requests, bypass=True), 1000).total()
    assert static["hits"] == 16 and static["copied"] == 2  # the preload is paid at first use
    assert opt["hits"] == 16


def test_converter_names_a_bad_forward_sizes_in_one_line(tmp_path, capsys):
    """`--forward-sizes 3,a`: exit 2 with the value named, not a traceback out of argparse."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"type": "route", "req_id": "r0", "token_idx": 0, "layer": 0, "topk_ids": [1], "topk_weights": [1.0]}')
    assert _converter().main([str(log), "-o", str(tmp_path / "o.npz"), "--forward-sizes", "3,a"]) == 2
    err = capsys.readouterr().err
    assert "'a' is not N or N*K" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_wide_layers_leave_the_transition_input_out():
    """Above FOLLOW_MAX_EXPERTS experts a layer, adaptive keeps no transition tables, shadows or duel
    (their CPU and memory grow with the experts: 3.3x the policy's time per layer-step at 512), and
    ranks as without them; at Mixtral's 8 it learns them."""
    from strata.tiers import policy as pol

    rng = np.random.default_rng(3)
    for n_experts, on in ((8, True), (pol.FOLLOW_MAX_EXPERTS + 1, False), (512, False)):
        p = make_policy("adaptive", 3 * n_experts // 10, 4 * n_experts, n_experts=n_experts)
        slots = SlotMap(regions(p), n_experts)
        for _ in range(20):
            for layer in range(4):
                slots.request(sorted((layer * n_experts + rng.choice(n_experts, 2, replace=False)).tolist()), False)
        assert p.follow_on is on
        assert bool(p.followed) is on and bool(p.shadows[True]) is on
        assert not p.following or on
