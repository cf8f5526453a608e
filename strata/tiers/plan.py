"""The placement plan: a home tier for every tensor and a slot count for the device expert cache.

Built from tensor names, types and sizes only (`source.info`), so `strata plan` can print it
before a byte of weights is read. Rules, in order: `--override-tensor` regexes (first match
wins); experts go to `--pin-experts` (ram or disk); other weights go to the device for the
first `--gpu-layers` blocks, to RAM otherwise (embedding and output
projection included: they run where the generate loop runs). RAM is counted whole (`budget.py`):
dense weights as held, RAM experts, the RAM cache, a CPU stand-in for the device cache, the KV
cache and recurrent state at the context, and prefill scratch; without `--ctx-size` the context is
the longest that fits. A plan that cannot fit is refused with the numbers and the flag to change.
Without CUDA, `--experts-cache auto` (the default) allocates no stand-in: it would copy RAM into RAM.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from strata.errors import BadOption
from strata.formats.names import EXPERT_TENSOR
from strata.tiers import budget, hardware
from strata.tiers.auto import resolve_home
from strata.tiers.sizes import format_size, parse_fraction, parse_size
from strata.tiers.store import READERS, read_slack

LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.")
TIER_NAMES = {"gpu": "gpu", "cuda": "gpu", "device": "gpu", "cpu": "ram", "ram": "ram",
              "disk": "disk", "ssd": "disk"}
PROJECTIONS = ("gate", "up", "down")


@dataclass(slots=True)
class ExpertLayer:
    """One MoE layer's experts: three stacked tensors `[E, out, in]` sharing one home."""

    layer: int
    names: tuple[str, str, str]  # gate, up, down
    n_experts: int
    bytes_per_expert: int
    home: str  # gpu (pinned on the device), ram or disk

    @property
    def nbytes(self) -> int:
        return self.n_experts * self.bytes_per_expert


@dataclass(slots=True)
class Plan:
    homes: dict[str, str]  # tensor name -> gpu | ram | disk
    sizes: dict[str, int]  # tensor name -> bytes
    experts: list[ExpertLayer]
    device: str
    device_budget: int
    ram_budget: int
    gpu_layers: int
    n_layers: int
    slots: int = 0
    slot_bytes: int = 0
    prefill_reserve: int = 0
    ram_cache: int = 0
    device_is_cuda: bool = False
    memory: budget.MemoryPlan | None = None  # every RAM line, checked against ram_budget
    overrides: list[tuple[str, str, int]] = field(default_factory=list)  # regex, tier, tensors matched
    device_reserve: dict[str, int] = field(default_factory=dict)  # kv, recurrent, activations, scratch
    reserve_applies: bool = False  # a real device: the reserve is kept out of the expert cache
    ctx_size: int = 0
    dense_forms: dict[str, str] = field(default_factory=dict)  # device dense quantized weight -> blocks | dtype
    dense_extra: int = 0  # device bytes the dequantized ones add over their blocks

    @property
    def expert_names(self) -> set[str]:
        return {n for layer in self.experts for n in layer.names}

    def dense_bytes(self, tier: str) -> int:
        experts = self.expert_names
        held = sum(b for n, b in self.sizes.items() if self.homes[n] == tier and n not in experts)
        return held + (self.dense_extra if tier == "gpu" else 0)

    def expert_bytes(self, home: str | None = None) -> int:
        return sum(layer.nbytes for layer in self.experts if home in (None, layer.home))

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def reserved(self) -> int:
        """Device bytes kept for KV, state, activations and scratch (0 on the simulated device)."""
        return sum(self.device_reserve.values()) if self.reserve_applies else 0

    @property
    def n_experts(self) -> int:
        return sum(layer.n_experts for layer in self.experts)

    def tier_bytes(self) -> dict[str, int]:
        """What each tier holds: the device also holds the cache; RAM the disk experts' cache."""
        return {"gpu": self.dense_bytes("gpu") + self.expert_bytes("gpu") + self.cache_bytes + self.reserved,
                "ram": self.dense_bytes("ram") + self.expert_bytes("ram") + self.ram_cache,
                "disk": self.expert_bytes("disk")}


def make_plan(source, config, opts, device=None, ctx_size: int | None = None) -> Plan:
    """The plan for a model's tensors under `opts` (a TierOptions or EngineOptions); `ctx_size`
    (default: opts.ctx_size, else the model's context) sizes the device's KV reserve."""
    device = device or hardware.device_info()
    opts = resolve_home(source, opts)
    names = source.names()
    sizes = {n: source.info(n)[2] for n in names}
    n_layers = config.n_layers
    device_budget = _budget(opts.gpu_memory, "--gpu-memory", device.default_budget)
    ram_budget = _budget(opts.ram_memory, "--ram-memory", hardware.ram_default_budget())
    gpu_layers = _gpu_layers(opts.gpu_layers, n_layers, sizes, device_budget)
    rules = parse_overrides(opts.override_tensor)
    homes, matched = {}, [0] * len(rules)
    for name in names:
        homes[name] = _home(name, rules, matched, opts.pin_experts or "ram", gpu_layers)
    plan = Plan(homes, sizes, _expert_layers(source, names, homes), device.name, device_budget,
                ram_budget, gpu_layers, n_layers, device_is_cuda=device.is_cuda,
                overrides=[(r.pattern, t, n) for (r, t), n in zip(rules, matched)])
    _reserve_device(plan, source, config, opts, device, ctx_size)
    _check_disk_source(plan, source)
    _dense_forms(plan, source, opts, room=0)  # the forced ones count before the cache is sized
    _size_cache(plan, opts)
    _dense_forms(plan, source, opts, room=plan.device_budget - plan.dense_bytes("gpu") + plan.dense_extra
                 - plan.expert_bytes("gpu") - plan.reserved - plan.cache_bytes)
    _size_ram_cache(plan, opts, source, config)
    return plan


def _reserve_device(plan: Plan, source, config, opts, device, ctx_size) -> None:
    """KV at the context size, recurrent state, activations and scratch (`device_budget`); kept out
    of a CUDA device's budget before the cache is sized (the simulated device's memory is the RAM
    those already live in). With every block on the device, the embedding and output head go there
    too when they fit beside the reserve, so a step's hidden state never leaves it."""
    from strata.tiers import device_budget

    ctx = ctx_size or getattr(opts, "ctx_size", 0) or getattr(config, "context_length", 0) or 4096
    elt = {"float32": 4}.get(getattr(opts, "dtype", "bfloat16"), 2)
    chunk = min(getattr(opts, "prefill_chunk", 8192), ctx)
    plan.ctx_size = ctx
    plan.device_reserve = device_budget.reserve(source, config, ctx, chunk, elt, plan.device_budget)
    plan.reserve_applies = bool(getattr(device, "is_cuda", False))
    rules = parse_overrides(opts.override_tensor)
    head = [n for n, home in plan.homes.items() if home == "ram" and _beside_the_head(n, plan.n_layers)
            and not any(r.search(n) for r, _ in rules)]
    room = plan.device_budget - plan.dense_bytes("gpu") - plan.expert_bytes("gpu") - plan.reserved
    if plan.gpu_layers >= plan.n_layers and sum(plan.sizes[n] for n in head) <= room:
        plan.homes.update({n: "gpu" for n in head})


def _dense_forms(plan: Plan, source, opts, room: int) -> None:
    """Blocks or floats for each device dense quantized weight (`device_budget.dense_forms`)."""
    from strata.tiers import device_budget

    plan.dense_extra = 0
    plan.dense_forms, plan.dense_extra = device_budget.dense_forms(plan, source, getattr(opts, "dtype", "bfloat16"),
                                                                   room)


def _beside_the_head(name: str, n_layers: int) -> bool:
    """Embedding, output norm and head, and a draft (MTP) layer's non-expert weights: blk.N for N
    past the trunk reads the head's output, so it lives where the head does."""
    m = LAYER_TENSOR.match(name)
    return m is None or (int(m.group(1)) >= n_layers and not EXPERT_TENSOR.match(name))


def _budget(text, flag: str, default: int) -> int:
    return parse_size(text, flag) if text is not None else default


def _gpu_layers(text, n_layers: int, sizes: dict[str, int], budget: int) -> int:
    """auto: as many leading blocks' non-expert weights as the device budget holds."""
    text = str(text).strip().lower()
    if text == "all":
        return n_layers
    if text != "auto":
        try:
            n = int(text)
        except ValueError:
            raise BadOption(f"--gpu-layers {text!r} is not a number", "use auto, all or a count") from None
        if n < 0:
            raise BadOption(f"--gpu-layers must be >= 0, got {n}", "use auto, all or a count")
        return min(n, n_layers)
    per_layer = _dense_per_layer(sizes, n_layers)
    used, n = 0, 0
    while n < n_layers and used + per_layer[n] <= budget:
        used, n = used + per_layer[n], n + 1
    return n


def _dense_per_layer(sizes: dict[str, int], n_layers: int) -> list[int]:
    out = [0] * n_layers
    for name, b in sizes.items():
        m = LAYER_TENSOR.match(name)
        if m and not EXPERT_TENSOR.match(name) and int(m.group(1)) < n_layers:
            out[int(m.group(1))] += b
    return out


def parse_overrides(rules) -> list[tuple[re.Pattern, str]]:
    """`REGEX=TIER` strings -> compiled rules; tiers gpu/cuda, ram/cpu, disk/ssd."""
    out = []
    for rule in rules or ():
        pattern, sep, tier = str(rule).rpartition("=")
        tier_name = TIER_NAMES.get(tier.strip().lower())
        if not sep or not pattern or tier_name is None:
            raise BadOption(f"--override-tensor {rule!r} is not REGEX=TIER",
                            "write it like exps=CPU; tiers are gpu, ram (cpu) and disk")
        try:
            out.append((re.compile(pattern), tier_name))
        except re.error as e:
            raise BadOption(f"--override-tensor {rule!r}: bad regex ({e})") from None
    return out


def _home(name, rules, matched, expert_home, gpu_layers) -> str:
    for i, (regex, tier) in enumerate(rules):
        if regex.search(name):
            matched[i] += 1
            if tier == "disk" and not EXPERT_TENSOR.match(name):
                raise BadOption(f"--override-tensor {regex.pattern}=disk matches {name}, which is not an expert",
                                "only expert tensors (ffn_*_exps) can stay on disk")
            return tier
    if EXPERT_TENSOR.match(name):
        return expert_home
    m = LAYER_TENSOR.match(name)
    if m:
        return "gpu" if int(m.group(1)) < gpu_layers else "ram"
    # embedding rows, final norm and output projection run where the engine's loop runs
    return "ram"


def _expert_layers(source, names, homes) -> list[ExpertLayer]:
    found: dict[int, dict[str, str]] = {}
    for name in names:
        m = EXPERT_TENSOR.match(name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = name
    return [_expert_layer(source, layer, parts, homes) for layer, parts in sorted(found.items())]


def _expert_layer(source, layer: int, parts: dict[str, str], homes) -> ExpertLayer:
    names = tuple(parts[p] for p in PROJECTIONS)
    tiers = {homes[n] for n in names}
    if len(tiers) > 1:
        raise BadOption(f"layer {layer}: its expert tensors were sent to different tiers ({sorted(tiers)})",
                        "make --override-tensor match gate, up and down alike, e.g. blk\\.3\\.ffn_.*_exps=CPU")
    n_experts = source.info(names[0])[1][0]
    per_expert = sum(source.info(n)[2] for n in names) // n_experts
    return ExpertLayer(layer, names, n_experts, per_expert, tiers.pop())


def _check_disk_source(plan: Plan, source) -> None:
    if plan.expert_bytes("disk") and not hasattr(source, "file"):
        raise BadOption(f"{source.description}: experts can be read from disk only from a GGUF file",
                        "convert the model to GGUF or use --pin-experts ram")


def _size_cache(plan: Plan, opts) -> None:
    """Slots from --experts-cache: a size, N % of the cacheable experts, auto (what is left) or 0."""
    cacheable = [layer for layer in plan.experts if layer.home != "gpu"]
    plan.slot_bytes = max((layer.bytes_per_expert for layer in cacheable), default=0)
    n_cacheable = sum(layer.n_experts for layer in cacheable)
    fixed = plan.dense_bytes("gpu") + plan.expert_bytes("gpu") + plan.reserved
    if fixed > plan.device_budget:
        kept = f" + {format_size(plan.reserved)} kept for KV, state and activations" if plan.reserved else ""
        raise BadOption(f"the device needs {format_size(fixed - plan.reserved)} for non-expert weights of "
                        f"{plan.gpu_layers} layers{kept} but its budget is {format_size(plan.device_budget)}",
                        "lower --gpu-layers (or use auto), lower --ctx-size, or raise --gpu-memory")
    if not plan.slot_bytes:
        return
    free = plan.device_budget - fixed
    plan.slots = min(_requested_slots(opts.experts_cache, plan, n_cacheable, free), n_cacheable)
    _check_reserve(plan, opts.prefill_reserve)


def _requested_slots(text, plan: Plan, n_cacheable: int, free: int) -> int:
    text = "auto" if text is None else str(text).strip()
    if text.lower() == "auto":  # without CUDA a stand-in would only copy RAM into RAM
        return free // plan.slot_bytes if plan.device_is_cuda else 0
    frac = parse_fraction(text)
    if frac is not None:
        want = int(frac * n_cacheable) * plan.slot_bytes
    else:
        want = parse_size(text, "--experts-cache", allow_zero=True)
        if 0 < want < plan.slot_bytes:
            raise BadOption(f"--experts-cache {text} is smaller than one expert ({format_size(plan.slot_bytes)})",
                            f"use 0 for no cache, or at least {plan.slot_bytes} bytes")
    if want > free:
        raise BadOption(f"--experts-cache {text} needs {format_size(want)} but the device has "
                        f"{format_size(free)} left after {format_size(plan.device_budget - free)} of "
                        f"non-expert weights (budget {format_size(plan.device_budget)})",
                        "lower --experts-cache (or use auto), lower --gpu-layers, or raise --gpu-memory")
    return want // plan.slot_bytes


def _check_reserve(plan: Plan, reserve) -> None:
    reserve = int(reserve or 0)
    if reserve < 0 or reserve > plan.slots:
        raise BadOption(f"--prefill-reserve {reserve} must be between 0 and the cache's {plan.slots} slots",
                        "lower --prefill-reserve or raise --experts-cache")
    plan.prefill_reserve = reserve


def _size_ram_cache(plan: Plan, opts, source, config) -> None:
    """RAM must hold its dense weights, RAM-homed experts, the context and scratch (`budget.py`),
    and the disk experts' cache in what is left; refused, with every line, when it cannot."""
    in_ram = ("ram",) if plan.device_is_cuda else ("ram", "gpu")  # a simulated device is RAM too
    dense = budget.dense_held_bytes(source, [n for n, home in plan.homes.items()
                                             if home in in_ram and not EXPERT_TENSOR.match(n)])
    experts = sum(plan.expert_bytes(home) for home in in_ram)
    standin = 0 if plan.device_is_cuda else plan.cache_bytes
    fixed = dense + experts + standin
    mem = _context_budget(plan, opts, source, config, fixed)
    mem.dense, mem.experts, mem.device_standin = dense, experts, standin
    plan.memory = mem
    if mem.total > plan.ram_budget:
        raise BadOption(f"RAM needs {mem.describe()} but its budget is {format_size(plan.ram_budget)}",
                        _fix(plan, mem))
    disk = [layer for layer in plan.experts if layer.home == "disk"]
    if not disk:
        return
    # each reader holds one expert (its read lands in a fresh buffer) and its O_DIRECT staging buffer
    mem.scratch += 2 * READERS * max(layer.bytes_per_expert for layer in disk)
    plan.ram_cache = mem.ram_cache = _ram_cache_bytes(opts.ram_cache, plan, disk, plan.ram_budget - mem.total)
    if mem.total > plan.ram_budget:
        raise BadOption(f"--ram-cache {format_size(plan.ram_cache)} does not fit: RAM needs {mem.describe()} "
                        f"but its budget is {format_size(plan.ram_budget)}",
                        "lower --ram-cache or --ctx-size, or raise --ram-memory")


def _context_budget(plan: Plan, opts, source, config, fixed: int) -> budget.MemoryPlan:
    """The context (given, or the longest that fits), its prefill chunk, and their bytes."""
    dtype_bytes = 2 if getattr(opts, "dtype", "float32") in ("bfloat16", "float16") else 4
    sizes = budget.state_sizes(source, config, dtype_bytes)
    trained = getattr(config, "context_length", 0) or 4096
    chunk = getattr(opts, "prefill_chunk", 8192) or 8192
    given = getattr(opts, "ctx_size", 0) or 0
    free = plan.ram_budget - fixed
    ctx = given or budget.choose_context(sizes, config, free, trained, chunk, dtype_bytes)
    if not ctx:
        raise BadOption(f"RAM has {format_size(free)} left of its budget {format_size(plan.ram_budget)} after "
                        f"{format_size(fixed)} of weights and caches: not even a {budget.MIN_CONTEXT}-token "
                        f"context fits", _fix(plan, None))
    kv = budget.context_bytes(sizes, ctx)
    room = free if given else int(free * budget.CONTEXT_SHARE)  # a chosen context leaves the rest to caches
    chunk = budget.choose_chunk(config, ctx, min(chunk, ctx), max(room - kv, 0), dtype_bytes)
    return budget.MemoryPlan(plan.ram_budget, 0, 0, 0, 0, kv, budget.scratch_bytes(config, chunk, ctx, dtype_bytes),
                             ctx, not given, chunk)


def _fix(plan: Plan, mem) -> str:
    hints = []
    if plan.expert_bytes("ram"):
        hints.append("use --pin-experts disk")
    if mem is not None and not mem.ctx_chosen:
        hints.append("lower --ctx-size")
    if plan.cache_bytes and not plan.device_is_cuda:
        hints.append("lower --experts-cache")
    return ", ".join(hints + ["raise --ram-memory"])


def _ram_cache_bytes(text, plan: Plan, disk: list[ExpertLayer], free: int) -> int:
    # a cached expert holds its three reads' buffers, alignment slack included (`DiskHome` counts that)
    total = sum(layer.n_experts * (layer.bytes_per_expert + read_slack(layer.bytes_per_expert)) for layer in disk)
    one = max(layer.bytes_per_expert + read_slack(layer.bytes_per_expert) for layer in disk)
    if text is None:  # a quarter of the disk experts, within what the budget leaves
        return max(one, min(total // 4, free))
    frac = parse_fraction(text)
    size = int(frac * total) if frac is not None else parse_size(text, "--ram-cache")
    if size < one:
        raise BadOption(f"--ram-cache {text} is smaller than one expert ({format_size(one)})",
                        f"use at least {one} bytes")
    return min(size, total)


def summary(plan: Plan) -> dict:
    """The plan's numbers, for --json, engine.stats and tests."""
    per_gib = 2**30 // plan.slot_bytes if plan.slot_bytes else 0
    return {"device": plan.device, "device_budget": plan.device_budget, "ram_budget": plan.ram_budget,
            "tier_bytes": plan.tier_bytes(), "gpu_layers": plan.gpu_layers, "n_layers": plan.n_layers,
            "n_experts": plan.n_experts, "expert_bytes": plan.expert_bytes(),
            "bytes_per_expert": plan.slot_bytes, "experts_per_gib": per_gib, "slots": plan.slots,
            "cache_bytes": plan.cache_bytes, "prefill_reserve": plan.prefill_reserve,
            "ram_cache": plan.ram_cache, "device_reserve": dict(plan.device_reserve),
            "reserve_applies": plan.reserve_applies, "ctx_size": plan.ctx_size,
            "memory": plan.memory.as_dict() if plan.memory else None,
            "expert_homes": dict(Counter(layer.home for layer in plan.experts)),
            "dense_forms": dict(Counter(plan.dense_forms.values())), "dense_extra": plan.dense_extra}
