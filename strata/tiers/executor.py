"""The hybrid MoE executor: hits on the device from cache slots, misses on a CPU pool, at once.

Per layer the router's experts split into those on the device (cache hits, misses the
policy copies in, layers pinned to the device) and those computed on the CPU from their
home. Both halves multiply by the same stored bytes (on CUDA the device half by the Triton
kernels of `strata.kernels.gpu`, on the CPU by `strata.kernels`, else the reference grouped
product); their sum, in the router's weights, equals the all-resident output within
floating-point rounding, whatever the cache holds.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from itertools import chain

import torch

from strata import kernels
from strata.kernels import moe
from strata.kernels.gpu.graphs import boundary
from strata.kernels.grouped import route_table
from strata.kernels.threads import one_thread_if_small
from strata.tiers.device_cache import DeviceCache
from strata.tiers.stats import TierStats
from strata.tiers.store import ExpertFormat


def expert_source(fmt: ExpertFormat, parts):
    """The grouped product's weights argument: expert (or slot) -> its QTensors, from `parts(e)`'
    bytes (a home, a cache slot, a read)."""
    return lambda e: fmt.qtensors(parts(e))


def read_routing(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *riders: torch.Tensor):
    """The one device-to-host read of a tiered MoE layer's step: its routing ids (which experts,
    so which slots, copies and CPU work), with the router weights and the tokens' hidden states
    the CPU lane multiplies, and `riders` (the next layer's predicted ids, for the prefetcher),
    copied together and waited for once. CPU tensors come back as they are.

    Every host read of a tiered step goes through here (`HybridExecutor.read_host`), so tests count
    them and, under fake CUDA tensors, stand in for the values a device would return."""
    if x.device.type == "cpu":
        return (x, ids, weights, *riders)
    host = tuple(t.to("cpu", non_blocking=True) for t in (x, ids, weights, *riders))
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()
    return host


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host result onto the device without waiting for it there (pinned, asynchronous copy)."""
    if t.device == device:
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _first_once(source):
    """`source` whose first answer is kept for the one call that repeats it: the primitive asks
    for its first expert to check the types, then again to compute, and a disk home would
    count (and could read) that expert twice."""
    kept = {}

    def once(e):
        if e in kept:
            return kept.pop(e)
        out = source(e)
        if not once.asked:
            kept[e] = out
            once.asked = True
        return out
    once.asked = False
    return once


class CpuLane:
    """`threads` workers computing missed experts where their weights live (RAM or disk)."""

    def __init__(self, threads: int, homes: dict, formats: dict[int, ExpertFormat]):
        self.threads = max(1, threads)
        self.homes, self.formats = homes, formats
        self._token_kernels: dict[int, tuple | None] = {}  # layer -> kernels.token_expert_kernels (None: none apply)
        # each worker's torch operators on one thread: the workers are the parallelism, and a small
        # operator that opened torch's OpenMP team from a worker (a prompt's index_add_ per expert,
        # its sorts and gathers) waited on a peer thread busy with the other worker (1-5 ms a call
        # at load 3, against 3-7 us on one thread)
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="strata-cpu",
                                       initializer=torch.set_num_threads if self.threads > 1 else None,
                                       initargs=(1,) if self.threads > 1 else ())

    def submit(self, layer: int, x, ids, weights, experts: list[int]) -> list[Future]:
        if not experts:
            return []
        x, ids, weights = x.cpu(), ids.cpu(), weights.cpu()
        home = self.homes[layer]
        home.request(layer, experts)  # disk: start every read now, several in flight; compute as they land
        groups = [experts[i::self.threads] for i in range(min(self.threads, len(experts)))]
        in_prompt = kernels.in_prompt()  # the caller's thread: a prompt's products take prefill.c there too
        if len(groups) > 1 and x.shape[0] == 1 and not in_prompt and getattr(home, "arrival", None) is not None \
                and self._expert_kernels(layer, x) is not None:
            shared = _SharedLanding(self, layer, home, x, ids, weights, experts, groups)
            for _ in groups:
                self.pool.submit(shared.work)
            return shared.futures
        return [self.pool.submit(self._run, layer, x, ids, weights, set(g), in_prompt) for g in groups]

    def _run(self, layer, x, ids, weights, experts: set[int], in_prompt: bool = False) -> torch.Tensor:
        home = self.homes[layer]
        arrival = getattr(home, "arrival", None)
        with torch.inference_mode(), (kernels.prompt_batches() if in_prompt else nullcontext()):
            source = lambda: _first_once(expert_source(self.formats[layer], lambda e: home.parts(layer, e)))  # noqa: E731
            if arrival is None or x.shape[0] > kernels.FAST_BATCH_MAX:
                return moe.grouped_swiglu(x, route_table(ids, weights, experts), source())
            # a disk home at decode, in a verify pass, a decode batch or a prompt (chunk) of up to
            # FAST_BATCH_MAX rows: each expert as its read lands, the products summed in expert
            # order (so the result does not depend on which read came first, and each row is its
            # one-token step's); one read expert held at a time (one call over them all would hold
            # every one, past the RAM cache). Each worker's
            # products run on its own thread (the workers are the parallelism: a worker that also
            # asked for the kernels' helper threads would oversubscribe the cores, and wait at
            # their barrier once per expert)
            threads = 1 if self.threads > 1 else None
            general = lambda e: moe.grouped_swiglu(x, route_table(ids, weights, {e}), source(), threads=threads)  # noqa: E731
            one_token = x.shape[0] == 1 and not in_prompt
            if one_token or (in_prompt and x.shape[0] > 1):
                products = self._landing_products(layer, home, x, ids, weights, experts, threads, general, one_token)
                if products is not None:
                    return _sum_in_order(products, x)
            return _sum_in_order({e: general(e) for e in arrival(layer, sorted(experts))}, x)

    def _expert_kernels(self, layer, x):
        """The layer's `kernels.token_expert_kernels`, or None where they (or the kernels) do not apply."""
        spec = self._token_kernels.get(layer, False)
        if spec is False:  # the kernels depend on the layout only: planned on scratch bytes, once
            fmt = self.formats[layer]
            spec = kernels.token_expert_kernels(fmt.qtensors(fmt.split(torch.empty(fmt.nbytes, dtype=torch.uint8))),
                                                x.shape[-1])
            self._token_kernels[layer] = spec
        if spec is None or not kernels.USE_KERNELS or x.dtype is not torch.float32 or not x.is_contiguous():
            return None
        return spec

    def _landing_products(self, layer, home, x, ids, weights, experts: set[int], threads, general,
                          one_token: bool) -> dict | None:
        """A decode token's or a short prompt's experts of a disk home, each by one C call on its bytes
        as its read lands: a decode token's by strata_moe_token (`kernels.moe_token_at`, the call
        `moe.grouped_swiglu` makes for one token and one expert, so the same products), a prompt's
        (most take 1-2 of its rows) by strata_moe_tokens over its rows (`kernels.moe_tokens_at`, the
        call resident experts of a few rows take); an expert of PROMPT_AMX_MIN_ROWS rows or more, or
        whose call declines (its scratch not allocated), by `general(e)`. No route table, QTensor
        views or per-matrix plans: through them, 0.1-0.3 ms of Python an expert, and 2/3 of the
        full-size flagship's prompt-expert CPU was Python around the products. None where the
        kernels do not apply (then the general path runs)."""
        spec = self._expert_kernels(layer, x)
        if spec is None:
            return None
        k = ids.shape[-1]
        rows: dict[int, tuple[list[int], list[float]]] = {}
        for i, (e, w) in enumerate(zip(ids.reshape(-1).tolist(), weights.reshape(-1).tolist())):
            if e in experts:
                tokens, ws = rows.setdefault(e, ([], []))
                tokens.append(i // k)  # ascending: pairs come token by token
                ws.append(w)
        products = {}
        for e in home.arrival(layer, sorted(experts)):
            if e not in rows:  # asked for but routed by none of these rows (a prediction's read): adds nothing
                continue
            tokens, ws = rows[e]
            at = None if one_token else torch.tensor(tokens)
            # the general path's product: x-shaped, of a prompt only its rows (zeros elsewhere)
            fallback = lambda: general(e) if at is None else (at, general(e).index_select(0, at))  # noqa: E731
            if len(tokens) >= kernels.PROMPT_AMX_MIN_ROWS:
                products[e] = fallback()
                continue
            parts = home.parts(layer, e)  # held through the call: an evicted expert's buffer is read into again
            ptrs = tuple(p.data_ptr() for p in parts)
            if one_token:
                y = torch.zeros_like(x)
                ok = kernels.moe_token_at(x, [ptrs], spec, ws, threads, y)
            else:  # its own rows only (the products are row-independent): a layer's products hold
                # its routings' rows, not an x-sized tensor zeroed per expert
                y = torch.zeros(len(tokens), x.shape[-1])
                ok = kernels.moe_tokens_at(x.index_select(0, at), ptrs, spec, list(range(len(tokens))), ws,
                                           threads, y)
                y = (at, y)
            del parts
            products[e] = y if ok else fallback()  # declined: y is dropped
        return products

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _SharedLanding:
    """A decode token's disk-home experts, each computed by whichever worker is free as its read lands
    (one `arrival` order, taken under a lock), where a fixed half per worker left one worker idle while
    the other still had landed experts to compute (the full-size flagship at load 12: the two halves
    of a layer ended 8 ms apart, of a 36 ms layer). The products are summed per worker half in expert
    order, the last worker summing, so each half's sum, and the layer's output, is the fixed halves'
    bit for bit."""

    def __init__(self, lane: CpuLane, layer: int, home, x, ids, weights, experts: list[int], groups):
        self.lane, self.layer, self.home, self.x = lane, layer, home, x
        self.ids, self.weights, self.groups = ids, weights, groups
        self.spec = lane._expert_kernels(layer, x)
        self.w = dict(zip(ids.reshape(-1).tolist(), weights.reshape(-1).tolist()))
        self.order = home.arrival(layer, sorted(experts))
        self.products: dict[int, torch.Tensor] = {}
        self.futures = [Future() for _ in groups]
        self.left = len(groups)  # workers still taking experts
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def work(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._lock:  # a worker waiting here waits for the same reads as the one in next()
                        e = next(self.order, None) if self.error is None else None
                    if e is None:
                        break
                    if e in self.w:  # else asked for but not routed by this token (a prediction's read)
                        y = self._product(e)
                        with self._lock:
                            self.products[e] = y
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the futures
            with self._lock:
                self.error = self.error or err
        with self._lock:
            self.left -= 1
            if self.left:
                return
        for group, future in zip(self.groups, self.futures):
            try:
                if self.error is not None:
                    raise self.error
                future.set_result(_sum_in_order({e: self.products[e] for e in group if e in self.products}, self.x))
            except BaseException as err:  # noqa: BLE001 - a sum that fails must not leave its waiter hanging
                future.set_exception(err)

    def _product(self, e: int) -> torch.Tensor:
        """Expert e's product by strata_moe_token on its bytes; a declined call by the general path."""
        x, lane = self.x, self.lane
        y = torch.zeros_like(x)
        parts = self.home.parts(self.layer, e)  # held through the call: an evicted expert's buffer is read into again
        if kernels.moe_token_at(x, [tuple(p.data_ptr() for p in parts)], self.spec, [self.w[e]], 1, y):
            return y
        source = expert_source(lane.formats[self.layer], lambda i: self.home.parts(self.layer, i))
        return moe.grouped_swiglu(x, route_table(self.ids, self.weights, {e}), _first_once(source), threads=1)


def _sum_in_order(products: dict, x: torch.Tensor) -> torch.Tensor:
    """The experts' products summed in expert order, whatever order they were computed in. A product
    is x-shaped, or (rows, their products): added at those rows, the same sums (the other rows'
    zeros add nothing)."""
    out = torch.zeros_like(x)
    for e in sorted(products):
        y = products[e]
        if isinstance(y, tuple):
            out.index_add_(0, *y)
        else:
            out += y
    return out


class HybridExecutor:
    """Serves every MoE layer; `TieredExperts` is the per-module face the model calls."""

    def __init__(self, homes: dict, formats: dict[int, ExpertFormat], cache: DeviceCache | None,
                 lane: CpuLane, stats: TierStats, n_experts: int, device: torch.device, tracer=None):
        self.homes, self.formats, self.cache, self.lane = homes, formats, cache, lane
        self.stats, self.n_experts, self.device, self.tracer = stats, n_experts, device, tracer
        self._prefill = False
        self._disk_homes = [h for h in {id(h): h for h in homes.values()}.values() if getattr(h, "kind", None) == "disk"]
        self.positions = None
        self.read_host = read_routing  # the seam every host read of a tiered step goes through
        self.host_reads = 0
        self.prefetcher = None  # its next-layer prediction, when on the device, rides on the read

    @property
    def prefill(self) -> bool:
        """Whether this forward is a prompt's (wider than decode): its misses go to the reserved slots."""
        return self._prefill

    @prefill.setter
    def prefill(self, wide: bool) -> None:
        """Set per forward (every runtime and shard that drives this executor): a prompt's forward also
        holds its disk homes' RAM-cache populating until decode (`DiskHome.wide_forward`)."""
        wide = bool(wide)
        if wide != self._prefill:
            for home in self._disk_homes:
                home.wide_forward(wide)
        self._prefill = wide

    @boundary  # the routing read: compiled decode steps break their graph here (kernels/gpu/graphs.py)
    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            experts: set[int] | None = None, beside=None) -> torch.Tensor:
        """The layer's output over the routed experts (only those in `experts`, when given: a shard).
        `beside()` (the shared expert) runs here while the CPU workers compute and the reads land."""
        rider = None
        if self.prefetcher is not None:
            self.prefetcher.settle()  # a CPU prediction made beside this layer's attention: counted before it routes
            rider = self.prefetcher.take(layer)
        x_host, ids_host, weights_host, *predicted = self.read_host(
            x, ids, weights, *(() if rider is None else (rider[1],)))  # the step's one read back
        self.host_reads += 1
        if self.tracer is not None:
            self.tracer.record(layer, self.positions, ids_host, weights_host)
        served: dict[int, int] = {}  # token-routings per expert, ascending ids (a decode step's few ids: no torch op)
        for e in sorted(ids_host.reshape(-1).tolist()):
            served[e] = served.get(e, 0) + 1
        used = [e for e in served if experts is None or e in experts]
        on_device, on_cpu = self._split(layer, used, [served[e] for e in used])
        futures = self.lane.submit(layer, x_host, ids_host, weights_host, on_cpu)  # runs beside the device
        # none on the device (no cache, a cold one): the CPU halves' sum alone, which adding them to zeros gave
        out = self._device(layer, x, ids_host, weights_host, set(on_device)) if on_device or not futures else None
        if rider is not None:  # after this layer's kernels are queued: the copies wait for those only
            self.prefetcher.issue(rider[0], predicted[0], self.prefill, self.cache.mark() if self.cache else None)
        if beside is not None:  # on one thread: the CPU workers hold the cores
            with one_thread_if_small(0, x.device):
                beside()
        for f in futures:  # the host waits for its own threads; the device queue is not synchronised
            part = to_device(f.result(), self.device)
            out = part if out is None else out + part
        return out.to(x.device)

    def _split(self, layer: int, used: list[int], served: list[int] | None = None) -> tuple[list[int], list[int]]:
        """Experts for the device and for the CPU (the cache weighs each by the tokens it `served`);
        counts the step."""
        base = layer * self.n_experts
        keys = [base + e for e in used]
        kind = self.homes[layer].kind
        if kind == "gpu" or self.cache is None:  # pinned on the device, or no cache at all
            hits, copied, cpu = (keys, [], []) if kind == "gpu" else ([], [], keys)
        else:
            hits, copied, cpu = self.cache.request(keys, self.prefill, served)
        self.stats.step(layer, keys, hits, copied, cpu, self.formats[layer].nbytes)
        return [k - base for k in hits + copied], [k - base for k in cpu]

    def _device(self, layer, x, ids_host, weights_host, experts: set[int]) -> torch.Tensor:
        """The device half: hits and copied-in misses, from their slots (or the device home)."""
        if not experts:
            return torch.zeros_like(x, device=self.device)
        fmt, home = self.formats[layer], self.homes[layer]
        base = layer * self.n_experts
        if home.kind == "gpu":
            parts = lambda e: home.parts(layer, e)  # noqa: E731
        else:
            parts = lambda e: self.cache.parts(base + e, fmt)  # noqa: E731
        table = route_table(ids_host, weights_host, experts)  # the host copy: no second read
        return moe.grouped_swiglu(x.to(self.device), table, expert_source(fmt, parts), device_half=True)


class TieredExperts:
    """One MoE layer's face in the model (what `TieredProvider.layer` returns): its calls go to the
    provider's executor, built once the model is."""

    overlaps = True  # takes `beside`: other work to run while its experts are computed and read

    def __init__(self, provider, layer: int):
        self.provider, self.layer = provider, layer

    @boundary  # the outermost host call: dynamo would otherwise compile this per layer
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, beside=None) -> torch.Tensor:
        return self.provider.executor.run(self.layer, x, ids, weights, beside=beside)
