"""The tier options, shared by `strata run`, `strata plan` and `strata.load(...)`.

They are plain data: the planner turns them into a `Plan`, the runtime into caches.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

POLICIES = ("adaptive", "lru", "lfu", "static")
ADMISSION = ("auto", "always", "frequency")


@dataclass(slots=True)
class TierOptions:
    gpu_layers: str = "auto"  # auto | all | N: blocks whose non-expert weights live on the device
    gpu_memory: str | None = None  # device budget; default: 90 % of free CUDA memory (or half the RAM)
    ram_memory: str | None = None  # host budget; default: 90 % of available RAM
    pin_experts: str | None = None  # ram | disk | auto: where experts live; None = tiers off
    experts_cache: str | None = None  # SIZE | N% | auto | 0: the device expert cache
    ram_cache: str | None = None  # SIZE | N%: RAM cache in front of disk-homed experts
    cache_policy: str = "adaptive"
    admission: str = "auto"  # auto (the policy's own) | always | frequency
    prefill_reserve: int = 0  # slots kept for prefill's experts
    prefetch: bool = True
    override_tensor: tuple[str, ...] = ()  # "REGEX=TIER", first match wins
    trace_experts: str | None = None  # write routing decisions here (.npz) at close()
    hot_set: str | None = None  # a trace whose most-used experts seed the static policy


def tiers_requested(opts) -> bool:
    """Tiers are on as soon as one tier option differs from its default; else the plain resident path runs."""
    return any(getattr(opts, f.name) != f.default for f in fields(TierOptions))


def add_tier_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tiers (any of these, or a file larger than RAM, turns the tiered expert runtime on)")
    g.add_argument("--gpu-layers", default="auto", help="auto | all | N blocks' non-expert weights on the device")
    g.add_argument("--gpu-memory", help="device budget, e.g. 32G (default: 90%% of free CUDA memory)")
    g.add_argument("--ram-memory", help="host budget, e.g. 64G (default: 90%% of available RAM)")
    g.add_argument("--pin-experts", choices=["ram", "disk", "auto"],
                   help="experts' home: RAM, or read from the file; auto picks by available RAM")
    g.add_argument("--experts-cache", help="device expert cache: SIZE (23.44G, 512M), N%% of experts, auto or 0")
    g.add_argument("--ram-cache", help="RAM cache for disk-homed experts: SIZE or N%% of experts")
    g.add_argument("--cache-policy", default="adaptive", choices=POLICIES)
    g.add_argument("--admission", default="auto", choices=ADMISSION,
                   help="copy a miss into the cache (always), only if it beats the victim (frequency)")
    g.add_argument("--prefill-reserve", type=int, default=0, help="cache slots kept for prefill's experts")
    g.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                   help="do not predict the next layer's experts")
    g.add_argument("--override-tensor", "-ot", action="append", default=[], metavar="REGEX=TIER",
                   help="put matching tensors on gpu, ram (cpu) or disk; repeatable, first match wins")
    g.add_argument("--trace-experts", metavar="FILE", help="record routing decisions to FILE (.npz)")
    g.add_argument("--hot-set", metavar="TRACE", help="seed the static policy with a trace's hot experts")


def tier_options(args) -> dict:
    out = {f.name: getattr(args, f.name) for f in fields(TierOptions)}
    out["override_tensor"] = tuple(out["override_tensor"] or ())
    return out
