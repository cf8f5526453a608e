"""`--auto`: choose placement flags from what the machine has, and predict the hit rate.

RAM decides the experts' home (all pinned in RAM when they fit with room to spare, else read
from the file); the device takes as many blocks' always-used weights as fit and fills the
rest with expert cache. A routing trace, when given, is replayed at the chosen cache size.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

from strata.formats.names import EXPERT_TENSOR
from strata.tiers import hardware
from strata.tiers.sizes import format_size, parse_size

RAM_HEADROOM = 0.85  # experts + other weights may take this share of the RAM budget


def choose_home(source, ram_budget: int) -> tuple[str, str]:
    """ram or disk for the experts, with the reason in words."""
    sizes = {n: source.info(n)[2] for n in source.names()}
    experts = sum(b for n, b in sizes.items() if EXPERT_TENSOR.match(n))
    rest = sum(sizes.values()) - experts
    if experts + rest <= RAM_HEADROOM * ram_budget:
        return "ram", (f"experts {format_size(experts)} + other weights {format_size(rest)} fit in "
                       f"{RAM_HEADROOM:.0%} of the RAM budget {format_size(ram_budget)}")
    return "disk", (f"experts {format_size(experts)} + other weights {format_size(rest)} exceed "
                    f"{RAM_HEADROOM:.0%} of the RAM budget {format_size(ram_budget)}: read from the file")


def exceeds_ram(source) -> bool:
    """A GGUF file whose weights RAM cannot hold next to the rest (`choose_home`'s rule at the default
    budget): mapped whole and paged by the kernel it thrashes (the 45.7 GiB flagship at 24 GB: 0.3
    tok/s, against 1.1-1.4 with its experts read from the file), so without tier flags its experts are
    read from the file, as `--pin-experts auto`. Other sources cannot read experts from disk."""
    return hasattr(source, "file") and choose_home(source, hardware.ram_default_budget())[0] == "disk"


def auto_options(source, opts, model_path: str) -> tuple[object, dict]:
    """`opts` with every placement choice filled in, and a dict saying what was detected."""
    device = hardware.device_info()
    ram_budget = parse_size(opts.ram_memory, "--ram-memory") if opts.ram_memory else hardware.ram_default_budget()
    home, why = choose_home(source, ram_budget)
    threads = max(1, (os.cpu_count() or 1) - (1 if device.is_cuda else 0))
    chosen = replace(opts, pin_experts=home, gpu_layers="auto", experts_cache="auto")
    detected = {"device": device.name, "device_budget": device.default_budget, "ram_budget": ram_budget,
                "free_disk": shutil.disk_usage(Path(model_path).resolve().parent).free,
                "cpu_threads": threads, "pin_experts_reason": why}
    return chosen, detected


def resolve_home(source, opts):
    """`--pin-experts auto`, or no --pin-experts once another tier flag is given (`--ram-memory` alone,
    say), becomes ram or disk before planning: a model larger than the budget runs from the file
    instead of being refused."""
    if opts.pin_experts not in ("auto", None):
        return opts
    ram_budget = parse_size(opts.ram_memory, "--ram-memory") if opts.ram_memory else hardware.ram_default_budget()
    return replace(opts, pin_experts=choose_home(source, ram_budget)[0])


def predict_hit_rate(trace_path: str, plan, policy: str) -> dict:
    """Replay a recorded trace at the plan's cache size: the policy's and MIN's hit rates."""
    from strata.tiers.cache_sim import simulate
    from strata.tiers.trace import load_trace

    trace = load_trace(trace_path)
    fraction = plan.slots / max(plan.n_experts, 1)
    row = simulate(trace, [policy], [fraction])["sizes"][0]
    return {"fraction": fraction, "policy": policy, "hit_rate": row["hit_rate"][policy],
            "min_hit_rate": row["hit_rate"]["min"], "tokens": int(trace.tokens.sum())}
