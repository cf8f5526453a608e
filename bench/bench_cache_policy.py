"""Cache policies on the demo model's routing: hit rates beside Belady's MIN, and a plot.

    .venv/bin/python bench/bench_cache_policy.py [--model strata/demo/strata-demo.gguf] [--tokens 2000]

Collects a trace of the model reading held-out text (`strata.demo.train.held_out_tokens`),
one token per forward pass as in decode, through `--trace-experts`; then replays it with
`strata.tiers.cache_sim` at 10..90 % of all experts. The acceptance bar: the adaptive policy
reaches >= 95 % of MIN's hit rate at 30 % and 70 % capacity.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import strata
from strata.tiers.cache_sim import ALL_POLICIES, plot, simulate, table
from strata.tiers.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "strata" / "demo" / "strata-demo.gguf"
BAR = 0.95


def collect(model: Path, tokens: int, trace_path: Path) -> dict:
    """Teacher-forced decode over held-out text, in context-sized windows; returns tier stats."""
    from strata.demo.train import held_out_tokens

    engine = strata.load(model, trace_experts=str(trace_path), experts_cache="0")
    ids = held_out_tokens(lambda text: engine.tokenizer.encode(text), tokens)
    window = min(engine.ctx_size, 512)
    with torch.inference_mode():
        for start in range(0, len(ids), window):
            cache = engine.model.new_cache(1)
            for t in ids[start:start + window]:
                engine.model(torch.tensor([[t]]), cache, last_only=True)
    stats = engine.tiers.stats()
    engine.close()
    return {"tokens": len(ids), "prefetch_accuracy": stats["total"]["prefetch_accuracy"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEMO)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--trace", type=Path, help="replay this trace instead of collecting one")
    p.add_argument("--sizes", default="10,30,50,70,90")
    p.add_argument("--out", type=Path, default=ROOT / "bench-out", help="where the trace and the plot go")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.trace
    if trace_path is None:
        if not args.model.exists():
            print(f"{args.model} does not exist: train it with `make demo-model`", file=sys.stderr)
            return 2
        trace_path = args.out / "cache_policy_trace.npz"
        info = collect(args.model, args.tokens, trace_path)
        print(f"trace: {info['tokens']} held-out tokens through {args.model.name}, "
              f"next-layer prediction accuracy {info['prefetch_accuracy']:.1%}\n")
    fractions = [float(s.strip().rstrip("%")) / 100 for s in args.sizes.split(",")]
    result = simulate(load_trace(trace_path), list(ALL_POLICIES), fractions)
    print(table(result, list(ALL_POLICIES)))
    png = args.out / "cache_policy.png"
    plot(result, list(ALL_POLICIES), str(png), f"expert cache hit rate: {(args.trace or args.model).name}")
    print(f"\nplot: {png}")
    return _verdict(result)


def _verdict(result: dict) -> int:
    ok = True
    for row in result["sizes"]:
        if round(row["fraction"], 2) in (0.3, 0.7):
            r = row["hit_rate"]
            ratio = r["adaptive"] / r["min"] if r["min"] else 0.0
            ok &= ratio >= BAR
            print(f"adaptive at {row['fraction']:.0%}: {r['adaptive']:.1%} vs MIN {r['min']:.1%} = "
                  f"{ratio:.1%} of MIN ({'meets' if ratio >= BAR else 'misses'} the {BAR:.0%} bar)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
