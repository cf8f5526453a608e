"""`strata inspect`: what a model file holds, read from headers only (nothing is loaded)."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from strata.argparser import ArgumentParser
from strata.formats.checkpoint import open_config


def describe(path) -> dict:
    arch, config, source, meta = open_config(path)
    kinds = {"experts": [0, 0], "other": [0, 0]}  # [tensor count, bytes]
    types: Counter = Counter()
    expert_bytes, n_experts, expert_layers = 0, 0, set()
    for name in source.names():
        if name.startswith("hf:"):
            continue
        qtype, shape, nbytes = source.info(name)
        kind = "experts" if "_exps" in name else "other"
        kinds[kind][0] += 1
        kinds[kind][1] += nbytes
        types[qtype] += nbytes
        if kind == "experts":
            expert_bytes += nbytes
            n_experts = shape[0]
            expert_layers.add(name.split(".")[1])
    total_experts = n_experts * len(expert_layers)
    per_expert = expert_bytes / total_experts if total_experts else 0
    return {
        "path": str(path), "architecture": arch.ARCH,
        "layers": getattr(config, "n_layers", None),
        "tensors": sum(k[0] for k in kinds.values()),
        "bytes": sum(k[1] for k in kinds.values()),
        "by_kind": {k: {"tensors": v[0], "bytes": v[1]} for k, v in kinds.items()},
        "quant_types": {t: b for t, b in types.most_common()},
        "experts": {"per_layer": n_experts, "moe_layers": len(expert_layers), "total": total_experts,
                    "bytes_per_expert": int(per_expert),
                    "experts_per_gb": round(2**30 / per_expert, 1) if per_expert else 0},
        "config": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                   for k, v in ((f, getattr(config, f)) for f in config.__dataclass_fields__)},
    }


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="strata inspect", description="Describe a model file.")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    d = describe(args.path)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    e = d["experts"]
    print(f"{d['path']}\n  architecture  {d['architecture']}, {d['layers']} layers")
    print(f"  tensors       {d['tensors']} ({_mb(d['bytes'])})")
    for kind, v in d["by_kind"].items():
        print(f"  {kind:<13} {v['tensors']} tensors, {_mb(v['bytes'])}")
    print("  quant types   " + ", ".join(f"{t} {_mb(b)}" for t, b in d["quant_types"].items()))
    if e["total"]:
        print(f"  experts       {e['per_layer']} x {e['moe_layers']} layers = {e['total']}, "
              f"{_mb(e['bytes_per_expert'])} each as stored, {e['experts_per_gb']} per GiB")
    return 0
