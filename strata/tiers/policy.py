"""Which experts the device cache keeps: replacement and admission, shared by runtime and simulator.

Keys are integers (`layer * n_experts + expert`). Per step, `access(keys, counts)` records
that one layer used keys (and how many of the step's tokens each served); `place(misses, protected)` decides, per miss, whether to copy it in
(and whom it evicts) or leave it to the CPU lane. Keys of the current step are protected.

- `lru`: recency only; every miss is copied in.
- `lfu`: frequency only (ties broken by recency); every miss is copied in.
- `adaptive` (the default): the probability that an expert is used the next time its layer
  runs, learned online from the routing itself: a table of how often an expert was used
  given how many runs of its layer ago it was last used and its share of the layer's
  token-routings (relative to the mean share). A batched step or a prefill chunk counts each
  expert by the tokens it served, not once, so a long prompt teaches the frequencies that a
  batch of decode steps would. The table is read as non-decreasing in that share (a sparse
  cell may not rank a rarer expert above a commoner one at the same lag), and a key's share
  starts from SHARE_PRIOR runs at the mean (two lucky runs do not make it the hottest). It
  evicts the least likely expert and copies a miss in only when the miss is likelier than
  that victim, so a one-off expert stays on the CPU. The table's estimate is then
  calibrated by a small logistic regression learned online on the next run's use (inputs:
  the table's log-odds, the lifetime share, the lag, and the key's share over the last few
  and the last few dozen runs): a key in a burst outranks one with the same lag and
  lifetime share that is not; each layer adds its own offset to that log-odds (learned on its
  runs, centred over the layers), as layers differ in how often a key with the same inputs is
  reused (top-k, skew). A key is ranked by how soon its next use is expected: the
  steps until its layer runs next (the cache sees a step's layers in order, so the layer
  that just ran waits longest) plus the runs a chance p takes on average, 1 / p - 1. Real routing
  differs in what predicts reuse (Mixtral's is close to memoryless, batched Qwen1.5-MoE's
  is all frequency); the table learns which, instead of a fixed blend of the two.
  A second calibration also weighs what follows what at a layer: over consecutive one-token
  runs (decode), the chance that an expert is used right after the layer's last run's whole
  expert set, smoothed towards the chance after that run's experts one by one, as a log-ratio
  to the expert's base rate. It pays on some routing (Mixtral's) and not on other (the demo
  model's), so two shadow resident sets of the cache's size, ranked without and with it, take
  every run's keys by the same rule, and the cache ranks with it while its shadow has hit more
  (decayed by DUEL_DECAY a run). A batched or prefill step says no transitions, so on batched
  routing both shadows agree and the cache ranks without it.
  A third shadow is kept by plain LFU (every miss admitted, the least-used evicted). Once the cache
  holds most of what a layer uses, the next-run chance ranks a just-used rare expert above a steady
  one unused for a few runs, where keeping the most-used pays more; so the LFU shadow's hits are
  duelled (DUEL_DECAY) against those of the adaptive shadow the cache follows, on one-token runs,
  and while LFU leads, the cache evicts first what the LFU shadow does not hold and admits what it
  does: its contents move to LFU's. Batched steps do not score this duel (a step of dozens of keys
  hits in lumps, and on ~100 batched steps the lead flips on noise between near-equal shadows).
- `static`: a fixed hot set (a ranking from a trace, or the first experts seen); never evicts.

Measured with bench/bench_cache_policy.py on public vLLM routing logs (Mixtral-8x7B-Instruct,
Qwen1.5-MoE-A2.7B-Chat, OLMoE-1B-7B) and the demo's trace; the tables are in bench/routing_logs.md.
Rejected there: LRFU with a fixed half-life (the previous default: at LRU's level on
Mixtral), a table with aged instead of lifetime frequency, following whichever of LFU and
the table has hit more lately (no better, three times slower), admitting every miss, a
ghost list that admits a miss rejected in its layer's last 2-8 runs (churns batched
routing), the table also non-increasing in lag (Mixtral's hot pairs alternate), and
scaling the next layer's estimates by an expert-id co-occurrence with the layer that just
ran (lower in both directions on Mixtral), per-layer tables shrunk to the shared one,
per-layer slot budgets moved by ghost hits, and ranking by an expected reuse distance per
cell instead of the use rate (no better, or lower, on the Mixtral traces), and raising or
lowering the estimates of the layers still to run in a step by their same-step co-occurrence
with the layer that just ran (lower on Mixtral; raising only: no change, as those keys are
seldom the victim once the rank counts the wait to the next run), a LIRS-like input (the gap
between a key's last two uses: 1.3 points lower on one Mixtral trace), and a share over the last
~64-128 runs or a table horizon of 1, 4 or 8 runs (each within about half a point, up or down,
on the Mixtral traces); the transition input ranked always (lowered the demo's trace below LFU at
60 %), per-key offsets, an admission margin, ARC-like per-layer slot targets and a ghost input
(no better, or lower, on Mixtral); for the LFU duel, comparing LFU against the better adaptive shadow
or the one without the input, a two-sigma gate, a switching margin of the keys LFU holds and the cache
does not, and scoring batched steps too (bench/routing_logs.md).

`SlotMap` puts a policy to work over the cache's regions (decode, prefill) and prefetches;
the runtime's `DeviceCache` and `strata cache-sim` both drive it, so they count alike.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

# Buckets of the adaptive policy's table. Lag: runs of the key's layer since its last use
# (0 = used in the latest run): 0, 1, 2, 3, 4-6, 7-12, 13-24, 25+, never used. Frequency: the
# key's share of its layer's token-routings over the mean share (1 / E), in these steps.
LAG_EDGES = np.array([1, 2, 3, 4, 7, 13, 25])
SHARE_EDGES = np.array([0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 6.0, 16.0, 64.0, 256.0])
HORIZON = 2  # the table's target: the key is used within this many runs of its layer
PRIOR = 2.0  # pseudo-observations at the layer's mean share, so an empty cell starts at the mean
TIE = 1e-3  # weight of the lifetime share beside the estimate: equal estimates evict the rarer key
SHARE_PRIOR = 2.0  # pseudo-runs at the mean share (1 / E) in a key's own share, so two runs cannot make it top
BURST_HALF_LIVES = (2.0, 16.0)  # runs of the key's layer: the recent-share features of the calibration
CALIBRATION_RATE = 0.02  # step of the calibration's online logistic regression (per run of a layer)
LAYER_RATE = 0.3  # step of a layer's own offset to the shared calibration's log-odds (per run of that layer)
NEVER_LAG = 50  # the lag feature of a key never used
FOLLOW_PRIOR = 1.0  # pseudo-runs at the base rate in the chance that an expert follows a layer's last experts
FOLLOW_SET_PRIOR = 16.0  # pseudo-runs at that pooled chance in the chance after the last run's whole expert set
FOLLOW_SETS = 1024  # expert sets remembered per layer (least recently seen dropped): bounds a wide layer's memory
DUEL_DECAY = 0.999  # per run, of the lead of the shadow cache that ranks with the transition input
# Layers of more experts than this leave the transition input out: its tables and duel cost CPU on
# every layer's run (48 layers x 512 experts, top-10, 30 %: 0.70 -> 2.30 ms a layer-step, 110 ms a
# token) and memory (an E x E table per layer, 1,024 remembered sets), more than the misses it saves
# where experts are small; every routing it was measured on (Mixtral's 8) is far below this.
FOLLOW_MAX_EXPERTS = 64

Placement = tuple[list[tuple[int, int | None]], list[int]]  # (admitted (key, victim)), rejected


class Policy:
    """Base: capacity in slots and the resident set; subclasses choose victims and admission."""

    name = "?"
    admit_all = True  # admission: copy every miss in (when a victim exists)

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.resident: set[int] = set()

    def access(self, keys: list[int], counts: list[int] | None = None) -> None:
        """One run of a layer used `keys`; `counts[i]` of the step's token-routings went to keys[i]
        (None: one each)."""

    def victim(self, protected: set[int]) -> int | None:
        raise NotImplementedError

    def admit(self, key: int, victim: int) -> bool:
        return self.admit_all

    def place(self, misses: list[int], protected: set[int], force: bool = False,
              confidence: float | None = None) -> Placement:
        """Per miss: copy in (evicting the victim) or reject. `force` skips admission (prefetch);
        with a `confidence` (the chance a prediction is right) a forced copy still evicts only a
        victim that the policy values below the prediction (`_worth`)."""
        admitted, rejected = [], []
        for key in misses:
            if len(self.resident) < self.capacity:
                admitted.append((key, None))
                self._insert(key)
                continue
            victim = self.victim(protected)
            if victim is None or not (force or self.admit(key, victim)) or not self._worth(key, victim, confidence):
                rejected.append(key)
                continue
            self._remove(victim)
            self._insert(key)
            admitted.append((key, victim))
        return admitted, rejected

    def _worth(self, key: int, victim: int, confidence: float | None) -> bool:
        """Whether a prefetch of `key`, right with chance `confidence`, may evict `victim`: always,
        for policies that keep no estimate of a key's chance of use."""
        return True

    def _insert(self, key: int) -> None:
        self.resident.add(key)

    def _remove(self, key: int) -> None:
        self.resident.discard(key)


class LRU(Policy):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.order: OrderedDict[int, None] = OrderedDict()

    def access(self, keys, counts=None):
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


class Packed(Policy):
    """Resident keys packed in an array, so a victim is one vectorised argmin over them."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.keys = np.zeros(capacity, dtype=np.int64)
        self.index: dict[int, int] = {}  # key -> position in self.keys

    def ranks(self, resident: np.ndarray) -> np.ndarray:
        """Per resident key, lower = evicted first."""
        raise NotImplementedError

    def place(self, misses, protected, force=False, confidence=None):
        self.cached, self.fresh = None, {}  # ranks change only when a layer runs: score each key once a step
        try:
            return super().place(misses, protected, force, confidence)
        finally:
            self.cached, self.fresh = None, {}

    def rank_of(self, key: int) -> float:
        """One key's rank, from this step's scores where it has one."""
        if getattr(self, "cached", None) is not None and key in self.index:
            return float(self.cached[self.index[key]])
        fresh = getattr(self, "fresh", {})
        if key not in fresh:
            fresh[key] = float(self.ranks(np.array([key], dtype=np.int64))[0])
        return fresh[key]

    def victim(self, protected):
        if not self.index:
            return None
        resident = self.keys[:len(self.index)]
        if getattr(self, "cached", None) is None:
            self.cached = np.empty(self.capacity)
            self.cached[:len(resident)] = self.ranks(resident)
        ranks = self.cached[:len(resident)].copy()
        for k in protected:
            if k in self.index:
                ranks[self.index[k]] = np.inf
        i = int(np.argmin(ranks))
        return None if ranks[i] == np.inf else int(resident[i])

    def _insert(self, key):
        super()._insert(key)
        self.index[key] = len(self.index)
        self.keys[self.index[key]] = key
        if getattr(self, "cached", None) is not None:
            self.cached[self.index[key]] = self.rank_of(key)

    def _remove(self, key):
        super()._remove(key)
        i, last = self.index.pop(key), len(self.index)
        if i != last:  # move the last resident key into the hole
            moved = int(self.keys[last])
            self.keys[i], self.index[moved] = moved, i
            if getattr(self, "cached", None) is not None:
                self.cached[i] = self.cached[last]


class Scored(Packed):
    """Keeps a score per key (resident or not) in an array; the victim has the lowest score."""

    def __init__(self, capacity: int, n_keys: int):
        super().__init__(capacity)
        self.score = np.full(n_keys, -np.inf)

    def ranks(self, resident):
        return self.score[resident]


class LFU(Scored):
    """Use counts, with a small recency term so equal counts evict the least recent."""

    name = "lfu"

    def __init__(self, capacity: int, n_keys: int):
        super().__init__(capacity, n_keys)
        self.score[:] = 0.0
        self.clock = 0

    def access(self, keys, counts=None):
        self.clock += 1
        for k in keys:
            self.score[k] = np.floor(self.score[k]) + 1 + self.clock * 1e-9


class Adaptive(Packed):
    """Evicts the expert whose next use is expected latest, by a chance of use learned online.

    Each access of a layer first scores the table: for every expert of that layer, its cell
    (lag since last use, frequency share) saw one more run, and one more use if it was used.
    The cell's smoothed use rate is then the estimate for any key in that cell. Ages and
    frequencies count runs of the key's own layer, so a layer that runs less often (an MTP
    draft layer, a batched forward) is measured on its own clock.
    """

    name = "adaptive"
    admit_all = False

    def __init__(self, capacity: int, n_keys: int, n_experts: int, horizon: int = HORIZON):
        super().__init__(capacity)
        self.n_experts = max(n_experts, 1)
        self.horizon = horizon
        self.waiting: dict[int, deque] = {}  # layer -> (run, lag cells, share cells) not yet scored
        n_layers = max(-(-n_keys // self.n_experts), 1)
        self.runs = np.zeros(n_layers, dtype=np.int64)  # runs of each layer so far
        self.now = -1  # the layer that ran last: keys of the layers after it run sooner in this step
        self.span = 1  # layers in a step: the highest layer that has run, + 1 (a draft layer may never run)
        self.mean_share = np.zeros(n_layers)  # experts used per run / E, running mean
        self.last = np.full(n_layers * self.n_experts, -1, dtype=np.int64)  # run of the last use
        self.routed = np.zeros(n_layers * self.n_experts)  # sum over runs of the key's share of the run
        shape = (len(LAG_EDGES) + 2, len(SHARE_EDGES) + 1)
        self.seen = np.zeros(shape)  # per cell: (key, run) pairs observed
        self.used = np.zeros(shape)  # of those, the key was used within the horizon
        self.burst = np.zeros((len(BURST_HALF_LIVES), len(self.last)))  # recent share of the layer's routings
        self.weights = np.zeros(len(BURST_HALF_LIVES) + 4)  # the calibration: starts as the table itself
        self.weights[0] = 1.0
        self.offset = np.zeros(n_layers)  # per layer, added to the shared log-odds; centred over the layers that ran
        self.inputs: dict[int, np.ndarray] = {}  # layer -> its keys' calibration inputs after its last run
        self.observed = None  # the table's use rates, running maximum over share (cached between runs)
        # Per key, what changes only when its layer runs, kept from that run (ranking reads these, so it
        # does not recompute them for every resident key at every step): the table cell, the lifetime
        # share, and the calibration's inputs other than the table's log-odds.
        self.lag_cell = np.zeros(len(self.last), dtype=np.int64)
        self.share_cell = np.zeros(len(self.last), dtype=np.int64)
        self.share = np.zeros(len(self.last))
        self.features = np.zeros((len(self.last), len(BURST_HALF_LIVES) + 2))
        self._refresh(np.arange(len(self.last)))
        # What follows what at a layer (consecutive one-token runs), the input of a second calibration
        # (own weights and layer offsets), and the duel that decides whether the cache ranks with it.
        self.followed: dict[int, np.ndarray] = {}  # layer -> [a, b]: b used in the run after a run using a
        self.leads = np.zeros((n_layers, self.n_experts))  # [layer, a]: one-token runs using a that one followed
        self.single_uses = np.zeros(n_layers * self.n_experts)  # uses in one-token runs
        self.single_runs = np.zeros(n_layers)
        self.previous: dict[int, np.ndarray] = {}  # layer -> experts of its last run, if a one-token run
        self.after_set: dict[int, OrderedDict] = {}  # layer -> expert set -> [runs after it, {expert: uses}]
        self.follows = np.zeros(n_layers * self.n_experts)  # per key: log(chance after its layer's last run / base)
        self.follow_weights = np.insert(self.weights, len(self.weights) - 1, 0.0)  # the table at first, input at 0
        self.follow_offset = np.zeros(n_layers)
        self.follow_inputs: dict[int, np.ndarray] = {}
        self.shadows = {False: set(), True: set()}  # resident sets ranked without / with the input
        self.lead = 0.0  # decayed hits of the shadow with the input over the one without
        self.following = False  # the cache ranks with the input while its shadow leads
        self.follow_on = self.n_experts <= FOLLOW_MAX_EXPERTS  # off for wide layers (FOLLOW_MAX_EXPERTS)
        # A third shadow resident set kept by plain LFU (every miss admitted, the least-used non-run key evicted,
        # ties to the least recent), duelled against the adaptive shadow the cache follows, on one-token runs:
        # while it leads, the cache evicts and admits towards its contents (`ranks`).
        self.lfu_shadow: set[int] = set()
        self.in_lfu = np.zeros(len(self.last), dtype=bool)  # per key: held by the LFU shadow
        self.lfu_uses = np.zeros(len(self.last))  # per key: runs that used it (LFU's count)
        self.lfu_seen = np.zeros(len(self.last))  # per key: the layer-step of its last use (LFU's tie-break)
        self.steps = 0  # layer-steps so far
        self.lfu_lead = 0.0  # decayed hits of the LFU shadow over the adaptive shadow the cache follows
        self.following_lfu = False

    def _cells(self, keys: np.ndarray):
        layer = keys // self.n_experts
        runs = self.runs[layer]
        never = self.last[keys] < 0
        lag = np.searchsorted(LAG_EDGES, runs - self.last[keys], side="right")
        lag = np.where(never, len(LAG_EDGES) + 1, lag)
        share = (self.routed[keys] + SHARE_PRIOR / self.n_experts) / (runs + SHARE_PRIOR)  # of the layer's token-routings
        return lag, np.searchsorted(SHARE_EDGES, share * self.n_experts, side="right"), self.mean_share[layer], share

    def table(self, keys: np.ndarray) -> np.ndarray:
        """Per key: the cell's use rate, shrunk towards the layer's mean by PRIOR pseudo-runs; the
        observed part taken as the running maximum over the rarer cells at the same lag."""
        if self.observed is None:  # the table changes only when a layer runs
            self.observed = np.maximum.accumulate(self.used / (self.seen + PRIOR), axis=1)
        lag, freq = self.lag_cell[keys], self.share_cell[keys]
        return self.observed[lag, freq] + PRIOR / (self.seen[lag, freq] + PRIOR) * self.mean_share[keys // self.n_experts]

    def inputs_of(self, keys: np.ndarray) -> np.ndarray:
        """The calibration's inputs per key: the table's log-odds, log lifetime share over the
        mean, log(1 + lag), log recent shares over the mean, and a constant."""
        p = np.clip(self.table(keys), 1e-4, 1 - 1e-4)
        return np.column_stack([np.log(p / (1 - p)), self.features[keys], np.ones(len(keys))])

    def _refresh(self, keys: np.ndarray) -> None:
        """Keep the cells, shares and inputs of `keys` (all of one layer, or all keys) after a run."""
        lag_cell, share_cell, _, share = self._cells(keys)
        self.lag_cell[keys], self.share_cell[keys], self.share[keys] = lag_cell, share_cell, share
        lag = np.where(self.last[keys] < 0, NEVER_LAG, self.runs[keys // self.n_experts] - self.last[keys])
        recent = [np.log(b[keys] * self.n_experts + 0.05) for b in self.burst]
        self.features[keys] = np.column_stack([np.log(share * self.n_experts), np.log1p(lag), *recent])

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Per key: the chance of a use at its layer's next run, the table calibrated, plus its layer's
        offset (layers differ in how often a key with the same inputs is used again: top-k, skew)."""
        return 1 / (1 + np.exp(-(self.inputs_of(keys) @ self.weights + self.offset[keys // self.n_experts])))

    def following_inputs_of(self, keys: np.ndarray) -> np.ndarray:
        """The calibration's inputs with the transition input before the constant."""
        x = self.inputs_of(keys)
        return np.column_stack([x[:, :-1], self.follows[keys], x[:, -1:]])

    def estimate_following(self, keys: np.ndarray) -> np.ndarray:
        """The chance of a use at the layer's next run by the second calibration, which also weighs
        how much likelier the key is after its layer's last run's experts than on average."""
        return 1 / (1 + np.exp(-(self.following_inputs_of(keys) @ self.follow_weights
                                 + self.follow_offset[keys // self.n_experts])))

    def access(self, keys, counts=None):
        if not keys:
            return
        layer = keys[0] // self.n_experts
        every = np.arange(layer * self.n_experts, (layer + 1) * self.n_experts)
        self.now, self.span = layer, max(self.span, layer + 1)
        used = np.asarray(keys, dtype=np.int64)
        lead = (len(self.shadows[True].intersection(keys)) - len(self.shadows[False].intersection(keys))
                if self.follow_on else 0)
        hit = np.zeros(self.n_experts)
        hit[used - every[0]] = 1.0
        ran = self.runs > 0  # offsets centred: the shared intercept keeps the common level (one layer: offset 0)
        if layer in self.inputs:  # one gradient step of the calibration and of the layer's offset on this run's outcome
            x = self.inputs[layer]
            error = hit - 1 / (1 + np.exp(-(x @ self.weights + self.offset[layer])))
            self.weights += CALIBRATION_RATE * x.T @ error / len(x)
            self.offset[layer] += LAYER_RATE * error.mean()
            self.offset[ran] -= self.offset[ran].mean()
        if layer in self.follow_inputs:  # the same for the calibration with the transition input
            x = self.follow_inputs[layer]
            error = hit - 1 / (1 + np.exp(-(x @ self.follow_weights + self.follow_offset[layer])))
            self.follow_weights += CALIBRATION_RATE * x.T @ error / len(x)
            self.follow_offset[layer] += LAYER_RATE * error.mean()
            self.follow_offset[ran] -= self.follow_offset[ran].mean()
        waiting = self.waiting.setdefault(layer, deque())  # the cells as they stand since the layer's last run
        waiting.append((int(self.runs[layer]), self.lag_cell[every].copy(), self.share_cell[every].copy()))
        self.runs[layer] += 1
        self.mean_share[layer] += (len(keys) / self.n_experts - self.mean_share[layer]) / min(self.runs[layer], 64)
        served = np.ones(len(used)) if counts is None else np.asarray(counts, dtype=np.float64)
        share = served / served.sum()
        np.add.at(self.routed, used, share)
        self.last[used] = self.runs[layer]
        if self.runs[layer] - waiting[0][0] >= self.horizon:  # the oldest observation's horizon has passed
            self.observed = None
            run, lag, freq = waiting.popleft()
            np.add.at(self.seen, (lag, freq), 1)
            np.add.at(self.used, (lag[self.last[every] > run], freq[self.last[every] > run]), 1)
        run_share = np.zeros(self.n_experts)
        run_share[used - every[0]] = share
        for b, half_life in zip(self.burst, BURST_HALF_LIVES):
            b[every] += (1 - 0.5 ** (1 / half_life)) * (run_share - b[every])
        self._refresh(every)
        self.inputs[layer] = self.inputs_of(every)
        if self.follow_on:
            self._follow(layer, used - every[0], counts is None or sum(counts) == len(keys))
            self.follow_inputs[layer] = self.following_inputs_of(every)
            self.lead = DUEL_DECAY * self.lead + lead
            if counts is None or sum(counts) == len(keys):  # one-token run: the LFU duel's evidence
                followed = len(self.shadows[self.following].intersection(keys))
                self.lfu_lead = DUEL_DECAY * self.lfu_lead + len(self.lfu_shadow.intersection(keys)) - followed
            self._lfu_place(keys)
            self.following_lfu = self.lfu_lead > 0
            self.following = self.lead > 0
            self._shadows_place(keys)

    def _follow(self, layer: int, experts: np.ndarray, one_token: bool) -> None:
        """Learn which experts a layer uses right after which (consecutive one-token runs: a decode
        step's token follows the last one's), and score every expert of the layer for its next run:
        the chance after the last run's whole expert set, smoothed towards the chance pooled over that
        run's experts one by one, itself smoothed towards the base rate. A batched or prefill step
        names experts without saying which token used which, so it teaches nothing and leaves no score."""
        E, rows = self.n_experts, slice(layer * self.n_experts, (layer + 1) * self.n_experts)
        if not one_token:
            self.previous.pop(layer, None)
            self.follows[rows] = 0.0
            return
        sets = self.after_set.setdefault(layer, OrderedDict())
        if layer in self.previous:
            before = self.previous[layer]
            followed = self.followed.setdefault(layer, np.zeros((E, E), dtype=np.float32))
            followed[np.ix_(before, experts)] += 1
            self.leads[layer][before] += 1
            entry = sets.setdefault(tuple(before.tolist()), [0, {}])
            entry[0] += 1
            for e in experts.tolist():
                entry[1][e] = entry[1].get(e, 0) + 1
        current = np.sort(experts)
        self.previous[layer] = current
        self.single_uses[rows][experts] += 1
        self.single_runs[layer] += 1
        base = (self.single_uses[rows] + 1) / (self.single_runs[layer] + E / len(experts))
        followed = self.followed.get(layer)
        pooled = ((followed[current].sum(0) if followed is not None else 0) + FOLLOW_PRIOR * base) / (
            self.leads[layer][current].sum() + FOLLOW_PRIOR)
        entry = sets.get(tuple(current.tolist()))
        after = pooled
        if entry is not None:
            sets.move_to_end(tuple(current.tolist()))
            uses = np.zeros(E)
            uses[list(entry[1])] = list(entry[1].values())
            after = (uses + FOLLOW_SET_PRIOR * pooled) / (entry[0] + FOLLOW_SET_PRIOR)
        while len(sets) > FOLLOW_SETS:
            sets.popitem(last=False)
        self.follows[rows] = np.log(np.clip(after, 1e-4, 1) / np.clip(base, 1e-4, 1))

    def _lfu_place(self, keys: list[int]) -> None:
        """The LFU shadow takes this run's keys as `LFU` would: each used key counts one more use, every
        miss is admitted, evicting the non-run key of fewest uses (the least recent among equals)."""
        self.steps += 1
        used = np.asarray(keys, dtype=np.int64)
        self.lfu_uses[used] += 1
        self.lfu_seen[used] = self.steps
        shadow = self.lfu_shadow
        out = [k for k in keys if k not in shadow]
        free = max(self.capacity - len(shadow), 0)
        shadow.update(out[:free])
        self.in_lfu[out[:free]] = True
        out = out[free:]
        candidates = np.array(sorted(shadow.difference(keys)), dtype=np.int64)
        if not out or not len(candidates):
            return
        score = self.lfu_uses[candidates] + 1e-9 * self.lfu_seen[candidates]
        for key in out[:len(candidates)]:
            i = int(np.argmin(score))
            shadow.discard(int(candidates[i]))
            shadow.add(key)
            self.in_lfu[[candidates[i], key]] = False, True
            score[i] = np.inf

    def _shadows_place(self, keys: list[int]) -> None:
        """Two resident sets of the cache's size take this run's keys by the cache's own rule (the
        least valued evicted; a miss admitted only if valued above that victim), one ranked without
        the transition input and one with it: the duel compares the hits of the two. Both are scored
        in one pass over the keys either holds."""
        misses = {}
        for with_input, shadow in self.shadows.items():
            out = [k for k in keys if k not in shadow]
            free = max(self.capacity - len(shadow), 0)
            shadow.update(out[:free])
            if out[free:]:
                misses[with_input] = out[free:]
        if not misses:
            return
        held = np.fromiter(set().union(*(self.shadows[w] for w in misses)), dtype=np.int64)
        held = np.sort(held[~np.isin(held, keys)])
        incoming = np.array(sorted(set().union(*misses.values())), dtype=np.int64)
        ranks = dict(zip((False, True), zip(*(self._ranks_both(k) for k in (held, incoming)))))
        for with_input, out in misses.items():
            shadow = self.shadows[with_input]
            candidates = np.array(sorted(shadow.difference(keys)), dtype=np.int64)
            if not len(candidates):
                continue
            held_ranks, incoming_ranks = ranks[with_input]
            mine = held_ranks[np.searchsorted(held, candidates)]
            for key in out:
                rank = incoming_ranks[np.searchsorted(incoming, key)]
                i = int(np.argmin(mine))
                if mine[i] == np.inf or not rank > mine[i]:
                    continue
                shadow.discard(int(candidates[i]))
                shadow.add(key)
                mine[i] = np.inf

    def _ranks_both(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ranks of `keys` without and with the transition input, from one pass over their inputs."""
        x = self.inputs_of(keys)
        layer = keys // self.n_experts
        without = 1 / (1 + np.exp(-(x @ self.weights + self.offset[layer])))
        x = np.column_stack([x[:, :-1], self.follows[keys], x[:, -1:]])
        with_input = 1 / (1 + np.exp(-(x @ self.follow_weights + self.follow_offset[layer])))
        return tuple(1 / (self._wait(keys) + 1 / np.maximum(c, 1e-6)) + TIE * self.share[keys] + 1e-12 * self.last[keys]
                     for c in (without, with_input))

    def _rank(self, keys: np.ndarray, with_input: bool) -> np.ndarray:
        chance = self.estimate_following(keys) if with_input else self.estimate(keys)
        return 1 / (self._wait(keys) + 1 / np.maximum(chance, 1e-6)) + TIE * self.share[keys] + 1e-12 * self.last[keys]

    def ranks(self, resident):
        """1 / (expected wait + 1): the wait being the steps until the key's layer runs next plus
        1 / p - 1 steps for its chance p of use at each run. Within a step the cache sees the layers
        in order, so a key of the layer that just ran waits a whole step for its next chance, while
        one of a layer still to run may be used in this step: at equal chances the first is evicted.
        The chance is the calibration's with the transition input while its shadow leads the duel.
        While the LFU shadow leads its duel, a key it holds outranks every key it does not (ranks are
        below 1), so the cache evicts what LFU would not hold and admits what it holds: the cache's
        contents move to the LFU shadow's, in its own order among the keys that leave."""
        rank = self._rank(resident, self.following)
        return rank + 2.0 * self.in_lfu[resident] if self.following_lfu else rank

    def admit(self, key, victim):
        return self.admit_all or self.rank_of(key) > self.rank_of(victim)

    def _worth(self, key, victim, confidence):
        """A prediction's key is ranked as the victim is, with the confidence as its chance: the
        prefetch evicts only a victim whose next use is expected later than the prediction's."""
        if confidence is None:
            return True
        value = float(self._rank(np.array([victim], dtype=np.int64), self.following)[0])  # without the LFU duel's lift
        return value < 1 / (self._wait(np.array([key]))[0] + 1 / max(confidence, 1e-6))

    def _wait(self, keys: np.ndarray) -> np.ndarray:
        """Steps until each key's layer runs next (1 for the layer that just ran)."""
        return ((keys // self.n_experts - self.now - 1) % self.span + 1) / self.span


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
    CPU; a prediction says the expert is about to be used) but evicts only an expert that
    the policy values below the prediction: `adaptive` ranks the predicted key as it ranks
    the victim (the expected wait to its next use), with the prediction's confidence as its
    chance, the confidence being the share of this layer's past predictions that were used
    (smoothed, so the first ones count as even odds). Every
    predicted expert on the device is pinned until its layer has run, so no other placement
    evicts it unused. A prediction is not a use: it changes no recency or frequency.
    """

    def __init__(self, regions: list[Region], n_experts: int):
        self.regions = regions
        self.n_experts = n_experts  # keys are layer * n_experts + expert
        self.where: dict[int, int] = {}  # key -> slot
        self.pinned: set[int] = set()  # prefetched for a layer that has not run yet
        self.pending: dict[int, set[int]] = {}  # layer -> keys predicted for its next run
        self.outcomes: dict[int, list[int]] = {}  # layer -> [predicted keys used, predicted keys]

    def request(self, keys: list[int], prefill: bool, counts: list[int] | None = None
                ) -> tuple[list[int], Copies, list[int]]:
        """(hits, misses copied in with their slots, misses left to the CPU) for one step's keys;
        `counts[i]`: how many of the step's token-routings went to keys[i] (None: one each)."""
        hits = [k for k in keys if k in self.where]
        misses = [k for k in keys if k not in self.where]
        region = self.region(prefill)
        for r in self.regions:
            if not (prefill and r.name == "main" and region is not None and region.name == "prefill"):
                r.policy.access(keys, counts)
        if keys:
            self._score_prediction(keys)
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
        if keys:
            self.pending.setdefault(keys[0] // self.n_experts, set()).update(keys)
        if region is None:
            return []
        confidence = self.confidence(keys[0] // self.n_experts) if keys else None
        admitted, _ = (region.policy.place(misses, set(keys) | self.pinned, force=True, confidence=confidence)
                       if misses else ([], []))
        copies = self._assign(region, admitted)
        self.pinned.update(k for k in keys if k in self.where)
        return copies

    def confidence(self, layer: int) -> float:
        """The chance that an expert predicted for `layer` is used: (used + 1) / (predicted + 2)."""
        used, predicted = self.outcomes.get(layer, (0, 0))
        return (used + 1) / (predicted + 2)

    def _score_prediction(self, keys: list[int]) -> None:
        predicted = self.pending.pop(keys[0] // self.n_experts, None)
        if predicted:
            counts = self.outcomes.setdefault(keys[0] // self.n_experts, [0, 0])
            counts[0] += len(predicted.intersection(keys))
            counts[1] += len(predicted)

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


def make_policy(name: str, capacity: int, n_keys: int, admission: str = "auto", n_experts: int | None = None,
                ranking=None) -> Policy:
    """A policy by name; `admission` may override its own rule (always / frequency).

    Keys are `layer * n_experts + expert` (`n_experts` defaults to all keys in one layer)."""
    if name == "lru":
        policy = LRU(capacity)
    elif name == "lfu":
        policy = LFU(capacity, n_keys)
    elif name == "adaptive":
        policy = Adaptive(capacity, n_keys, n_experts or n_keys)
    elif name == "static":
        policy = Static(capacity, ranking)
    else:
        raise ValueError(f"unknown policy {name!r}")
    if admission == "always":
        policy.admit_all = True
    elif admission == "frequency" and isinstance(policy, Scored):
        policy.admit_all = False
        policy.admit = lambda key, victim: policy.score[key] >= policy.score[victim]
    elif admission == "frequency" and isinstance(policy, Adaptive):
        policy.admit_all = False
    return policy
