"""The tiers behind a model's experts: plan, homes, device cache, executor, prefetch, trace.

The model is built with a `TieredProvider` as its experts provider (`strata.models.seams`): each
MoE layer hands it its stacked experts and gets a `TieredExperts` face back. `install(loaded,
options)` then builds the tiers over what the provider received and completes the provider; model
code never learns where an expert is, and nothing is assigned onto the model.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from strata.errors import StrataError
from strata.formats.weights import QTensor
from strata.kernels.gpu.graphs import boundary
from strata.tiers import hardware
from strata.tiers.device_cache import Copier, DeviceCache, SlotMemory
from strata.tiers.executor import CpuLane, HybridExecutor, TieredExperts
from strata.tiers.placement import place_blocks
from strata.tiers.plan import Plan, make_plan, summary
from strata.tiers.policy import make_policy, regions
from strata.tiers.prefetch import Prefetcher, router_predictors
from strata.tiers.stats import TierStats
from strata.formats.names import EXPERT_TENSOR
from strata.formats.ngram_hash import TABLE
from strata.tiers.dense_readahead import DenseReadahead, dense_spans
from strata.tiers.store import DiskHome, FileReader, RamHome, expert_format
from strata.tiers.trace import TraceRecorder, load_trace


class TierRuntime:
    """The installed tiers; `stats()` for engine.stats, `close()` writes the trace."""

    def __init__(self, plan: Plan, homes, executor: HybridExecutor, prefetcher, cache, reader, trace_path,
                 decode_width: int = 1):
        self.plan, self.homes, self.executor = plan, homes, executor
        self.prefetcher, self.cache, self.reader, self.trace_path = prefetcher, cache, reader, trace_path
        self.decode_width = decode_width  # the widest forward that is still decode (a verify pass)
        self.readahead = None  # DenseReadahead of a cold file's dense weights (install)
        self.closed = False

    @boundary  # host bookkeeping: eager between compiled segments
    def begin_block(self, block: int, x: torch.Tensor, step) -> None:
        """Before each block of a forward: step bookkeeping, then prefetch."""
        if block == 0:
            self.executor.prefill = step.width > self.decode_width
            self.executor.positions = step.positions[step.token_mask]
            if self.executor.tracer is not None:
                self.executor.tracer.next_step(self.executor.prefill)
        if self.prefetcher is not None:
            self.prefetcher(block, x, step.token_mask, self.executor.prefill)

    def stats(self) -> dict:
        resident = self.cache.resident_per_layer() if self.cache else {}
        resident.update({x.layer: x.n_experts for x in self.plan.experts if x.home == "gpu"})
        out = self.executor.stats.as_dict(resident)
        out["plan"] = summary(self.plan)
        out["policy"] = self.cache.regions[0].policy.name if self.cache else None
        out["homes"] = [h.stats() for h in _unique(self.homes.values())]
        return out

    def close(self) -> str | None:
        """Stop the worker threads and write the trace, if one was asked for; idempotent."""
        if self.closed:
            return None
        self.closed = True
        if self.readahead is not None:
            self.readahead.close()
        self.executor.lane.close()
        if self.cache is not None:
            self.cache.copier.close()
        for home in _unique(self.homes.values()):
            home.close()  # the disk readers, before the file closes
        path = None
        if self.trace_path and self.executor.tracer is not None:
            path = str(self.executor.tracer.save(self.trace_path))
        if self.reader is not None:
            self.reader.close()
        return path


def _unique(items):
    seen = {}
    for item in items:
        seen.setdefault(id(item), item)
    return list(seen.values())


class TieredProvider:
    """The tiers' `ExpertsProvider`: records each MoE layer's stacked experts as the model is built
    and answers with a `TieredExperts` face; `install` then builds the executor they call."""

    def __init__(self):
        self.weights: dict[int, tuple[QTensor, QTensor, QTensor]] = {}  # layer -> (gate, up, down)
        self.runtime: TierRuntime | None = None
        self.readahead: DenseReadahead | None = None  # started as the file opened (`read_ahead`)

    def read_ahead(self, source) -> None:
        """Once the file's header is parsed, before the model is built: start reading its dense
        weights ahead (`DenseReadahead`), so the disk streams them while the model, the tokenizer
        and the plan are built (about 2 s of the full-size flagship's load, the disk idle otherwise)
        instead of from the first forward on. Only where `install` would read them ahead: a GGUF
        file with stacked experts, no CUDA device."""
        tensors = getattr(getattr(source, "file", None), "tensors", None)
        if not tensors or self.readahead is not None or hardware.device_info().is_cuda:
            return
        experts = {n for n in tensors if EXPERT_TENSOR.match(n)}
        if experts:
            self.readahead = DenseReadahead(source.file.path, dense_spans(tensors, set(tensors) - _unread(experts)))

    def take_readahead(self, path, spans) -> DenseReadahead:
        """The dense read ahead of `spans` for the installed tiers: the one started as the file opened
        when it reads the same spans, else a new one (the early one stopped). The provider holds none
        after: from here the tiers close it."""
        early, self.readahead = self.readahead, None
        if early is not None and early.spans == spans:
            return early
        if early is not None:
            early.close()
        return DenseReadahead(path, spans)

    def close_readahead(self) -> None:
        """Stop a read ahead the load started and `install` did not take (the load failed, or the
        tiers read nothing ahead)."""
        if self.readahead is not None:
            self.readahead.close()
            self.readahead = None

    def layer(self, index: int, gate: QTensor, up: QTensor, down: QTensor) -> TieredExperts:
        self.weights[index] = (gate, up, down)
        return TieredExperts(self, index)

    @property
    def executor(self) -> HybridExecutor:
        if self.runtime is None:
            raise StrataError("the tiered experts ran before the tiers were installed",
                              "call strata.tiers.runtime.install(loaded, options) after building the model")
        return self.runtime.executor

    @boundary  # the outermost host call: dynamo would otherwise compile this per block index
    def begin_block(self, index: int, x: torch.Tensor, step) -> None:
        if self.runtime is not None:
            self.runtime.begin_block(index, x, step)


def install(loaded, options, byte_bar=None) -> TierRuntime:
    """Build the tiers for `loaded` (a LoadedModel built with a `TieredProvider` and, for the device,
    a `BlockPlacement`) under `options`, and complete its provider. `byte_bar(total)`: a context
    yielding `advance(n)`, shown while the RAM-homed experts are read (the loader passes one)."""
    provider = loaded.model.seams.experts
    if not isinstance(provider, TieredProvider):
        raise StrataError("the model was built without the tiers' experts provider",
                          "build it with Seams(experts=TieredProvider()) (strata.loader.load_with_tiers does)")
    device = hardware.device_info()
    plan = make_plan(loaded.source, loaded.config, options, device)
    if device.is_cuda:  # the plan's dense weights dequantized once here, the others kept as blocks
        floats = {n: getattr(torch, form) for n, form in plan.dense_forms.items() if form != "blocks"}
        place_blocks(loaded.model, plan, device.torch_device, floats)
    sources = provider.weights
    formats = _formats(sources, plan, loaded.source)
    n_experts = max((g.shape[0] for g, _, _ in sources.values()), default=1)
    reader = FileReader(loaded.source.file.path) if hasattr(loaded.source, "file") and sources else None
    built = []  # closers of the threads, arena and cache built so far, for a failure before the runtime holds them
    try:
        n = {layer.layer: layer.n_experts for layer in plan.experts}
        # pageable: the cache copies through bounded pinned staging
        in_ram = sum(layer.nbytes for layer in plan.experts if layer.home != "disk")
        with byte_bar(in_ram) if byte_bar else nullcontext(lambda n: None) as advance:
            homes = build_homes(plan, formats, reader, device,
                                lambda fmts, kind: RamHome(fmts, n, reader, sources, advance=advance))
        built.extend(home.close for home in _unique(homes.values()))
        cache = build_cache(plan, options, homes, formats, n_experts, device)
        if cache is not None:
            built.append(cache.copier.close)
        tracer = TraceRecorder(n_experts, {"model": str(getattr(loaded.source, "description", ""))},
                               {i: f.nbytes for i, f in formats.items()}) if options.trace_experts else None
        lane = CpuLane(getattr(options, "cpu_threads", 0) or 1, homes, formats)
        built.append(lane.close)
        executor = HybridExecutor(homes, formats, cache, lane, TierStats(), n_experts, device.torch_device, tracer)
        prefetcher = _prefetcher(loaded.model, options, cache, executor, formats, plan) if sources else None
        executor.prefetcher = prefetcher
        provider.runtime = TierRuntime(plan, homes, executor, prefetcher, cache, reader, options.trace_experts,
                                       _decode_width(loaded.model, options))
        # a failure from this line on leaves the early read ahead with the provider, which the loader's
        # failure path closes (`close_readahead`), and the runtime, which `install`'s own closes
        if reader is not None and not device.is_cuda:  # the dense weights stay in the mapping: read them ahead
            tensors = loaded.source.file.tensors
            spans = dense_spans(tensors, set(tensors) - _unread(plan.expert_names))
            provider.runtime.readahead = provider.take_readahead(reader.path, spans)
        else:
            provider.close_readahead()
    except BaseException:
        if provider.runtime is not None:  # it holds all of them, the reader and any read ahead it took
            provider.runtime.close()
            provider.runtime = None
        else:
            for close in reversed(built):
                close()
            if reader is not None:
                reader.close()
        raise
    return provider.runtime


def _unread(expert_names: set[str]) -> set[str]:
    """Tensors the dense read ahead leaves out: the stacked experts (their homes read them), the
    token embedding and the n-gram table (rows read on lookup)."""
    return expert_names | {"token_embd.weight", TABLE}


def _decode_width(model, options) -> int:
    """Forwards up to this wide are decode: 1 token, or a speculative verify pass (the last token
    and its drafts) when the model drafts. Wider ones are prefill chunks, served by the
    `--prefill-reserve` slots so they leave the decode hot set alone."""
    drafts = getattr(model, "mtp", None) is not None and getattr(options, "draft", "off") != "off"
    return 1 + (getattr(options, "draft_tokens", 0) if drafts else 0)


def _formats(sources, plan: Plan, source) -> dict:
    """layer -> ExpertFormat, from the layer's stacked (gate, up, down) as the model was built."""
    files = getattr(getattr(source, "file", None), "tensors", None)
    out = {}
    for layer in plan.experts:
        offsets = tuple(files[n].offset for n in layer.names) if files else None
        out[layer.layer] = expert_format(sources[layer.layer], offsets)
    return out


def build_homes(plan: Plan, formats, reader, device, ram_home) -> dict:
    """One DiskHome for the disk layers and one `ram_home(formats, kind)` for the RAM and device
    layers (moved to the device for "gpu"); layer -> home. The expert-parallel shards pass theirs."""
    by_kind: dict[str, list[int]] = {}
    for layer in plan.experts:
        by_kind.setdefault(layer.home, []).append(layer.layer)
    homes = {}
    try:
        for kind, layers in by_kind.items():
            fmts = {i: formats[i] for i in layers}
            if kind == "disk":
                home = DiskHome(fmts, reader, plan.ram_cache)
            else:
                home = ram_home(fmts, kind)
                homes.update({i: home for i in layers})  # before the move: a failed move still closes it
                if kind == "gpu":
                    home.to_device(device.torch_device)
            homes.update({i: home for i in layers})
    except BaseException:  # a home built before the failure stops its readers and frees its arena
        for home in _unique(homes.values()):
            home.close()
        raise
    return homes


def build_cache(plan: Plan, options, homes, formats, n_experts: int, device):
    if plan.slots == 0:
        return None
    n_keys = (max(formats) + 1) * n_experts
    main = plan.slots - plan.prefill_reserve
    ranking = _ranking(options.hot_set, n_experts) if options.hot_set else None
    policy = make_policy(options.cache_policy, main, n_keys, options.admission, n_experts, ranking)
    memory = SlotMemory(plan.slots, plan.slot_bytes, device.torch_device)
    cache = DeviceCache(memory, Copier(memory, homes, formats), regions(policy, plan.prefill_reserve), n_experts)
    cache.preload()
    return cache


def _ranking(path, n_experts: int) -> list[int]:
    """Keys of a trace's experts, most used first: the static policy's hot set."""
    trace = load_trace(path)
    counts: dict[int, int] = {}
    start = 0
    for layer, n in zip(trace.layer.tolist(), trace.tokens.tolist()):
        for e in trace.ids[start:start + n].reshape(-1).tolist():
            key = layer * n_experts + e
            counts[key] = counts.get(key, 0) + 1
        start += n
    return sorted(counts, key=lambda k: -counts[k])


def _prefetcher(model, options, cache, executor: HybridExecutor, formats, plan: Plan):
    if not options.prefetch:
        return None
    cached = {layer.layer for layer in plan.experts if layer.home != "gpu"}
    return Prefetcher(router_predictors(model), cache, executor.stats, executor.n_experts,
                      {i: f.nbytes for i, f in formats.items()}, cached, executor.tracer,
                      {i: h for i, h in executor.homes.items() if h.kind == "disk"},
                      submit=executor.lane.pool.submit if executor.lane.threads > 1 else None)

