"""Cache policies on real routing and on the demo's: hit rates beside the demand optimum `opt`.

    .venv/bin/python bench/bench_cache_policy.py [--real bench-out/routing] [--model strata/demo/strata-demo.gguf]

1. Per trace, every policy at 10..90 % of all experts: demand paging (no prefetch) as % of
   `opt` (Belady free to leave a miss on the CPU), and, where the trace holds the runtime's
   predictions, with prefetch on: hit rate and bytes copied per token off -> on. Traces:
   the public vLLM routing logs converted by bench/convert_routing_log.py into `--real`
   (bench/routing_logs.md says how to fetch and convert them; they are not shipped), each
   marked as tuned on or held out, with prefetch where `--predict` gave them next-layer
   predictions from the routing alone; and the demo model reading held-out text through the
   real runtime (`--trace-experts`, its own router predictions), one token per forward.
   The bars: the default policy (adaptive) at least as good as LRU and LFU at every size,
   >= 65 % of opt at 30 % and >= 85 % at 70 %, by demand alone.
2. `--prefill-reserve`: the real runtime decodes a text, then prefills a long unrelated
   prompt in chunks (as a second request would), then goes on decoding the first text; the
   decode hit rate right after the prefill, with and without reserved prefill slots (same
   total cache), beside the same decode with no prefill in between.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import strata
from strata.tiers.cache_sim import ALL_POLICIES, plot, replay_trace, simulate, table
from strata.tiers.trace import load_trace

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "strata" / "demo" / "strata-demo.gguf"
RUNTIME_SIZE = "30%"


def held_out(engine, n: int) -> list[int]:
    from strata.demo.train import held_out_tokens

    return held_out_tokens(lambda text: engine.tokenizer.encode(text), n)


def collect(model: Path, tokens: int, trace_path: Path, size: str = RUNTIME_SIZE) -> dict:
    """Teacher-forced decode over held-out text, in context-sized windows, through the real runtime
    (adaptive, prefetch on, a cache of `size`); returns its tier stats. The routing and the
    predictions do not depend on the cache, so one run gives the trace for every size."""
    engine = strata.load(model, trace_experts=str(trace_path), experts_cache=size)
    ids = held_out(engine, tokens)
    window = min(engine.ctx_size, 512)
    with torch.inference_mode():
        for start in range(0, len(ids), window):
            cache = engine.model.new_cache(1)
            for t in ids[start:start + window]:
                engine.model(torch.tensor([[t]]), cache, last_only=True)
    stats = engine.tiers.stats()
    engine.close()
    return {"tokens": len(ids), "prefetch_accuracy": stats["total"]["prefetch_accuracy"],
            "hit_rate": stats["total"]["hit_rate"], "slots": stats["plan"]["slots"]}


def decode(engine, cache, ids: list[int]) -> None:
    for t in ids:
        engine.model(torch.tensor([[t]]), cache, last_only=True)


def counts(engine) -> tuple[int, int]:
    t = engine.tiers.stats()["total"]
    return t["hits"], t["hits"] + t["misses"]


def after_prefill(model: Path, size: str, reserve: int, prompt_len: int, chunk: int, warm: int, after: int,
                  prefill: bool = True) -> dict:
    """Decode `warm` tokens, prefill `prompt_len` other tokens in `chunk`s on a second cache, decode
    `after` more tokens of the first text; the decode hit rate over those, and over their first 16."""
    engine = strata.load(model, experts_cache=size, prefill_reserve=reserve)
    ids = held_out(engine, warm + after + prompt_len)
    text, prompt = ids[:warm + after], ids[warm + after:]
    main = next(r for r in engine.tiers.cache.regions if r.name == "main").policy
    with torch.inference_mode():
        cache = engine.model.new_cache(1)
        decode(engine, cache, text[:warm])
        before = set(main.resident)
        if prefill:
            other = engine.model.new_cache(1)
            for start in range(0, len(prompt), chunk):  # wider than a decode step: served as prefill
                engine.model(torch.tensor([prompt[start:start + chunk]]), other, last_only=True)
        evicted = len(before - main.resident)
        h0, n0 = counts(engine)
        decode(engine, cache, text[warm:warm + 16])
        h1, n1 = counts(engine)
        decode(engine, cache, text[warm + 16:])
        h2, n2 = counts(engine)
    slots = engine.tiers.plan.slots
    engine.close()
    return {"slots": slots, "evicted": evicted, "main": len(before), "first16": (h1 - h0) / max(n1 - n0, 1),
            "after": (h2 - h0) / max(n2 - n0, 1)}


def prefill_report(model: Path, size: str, reserves: list[int], prompt_len: int = 512, chunk: int = 64,
                   warm: int = 256, after: int = 96) -> None:
    runs = [("no prefill in between", 0, False), ("prefill, no reserve", 0, True)]
    runs += [(f"prefill, --prefill-reserve {r}", r, True) for r in reserves]
    print(f"\ndecode hit rate right after a {prompt_len}-token prefill (chunks of {chunk}) on another cache; "
          f"cache {size} of experts, adaptive, prefetch on; {warm} decode tokens before, {after} after")
    print(f"{'':>36} {'slots':>6} {'main':>5} {'evicted':>8} {'first 16':>9} {f'all {after}':>8}")
    for label, r, prefill in runs:
        x = after_prefill(model, size, r, prompt_len, chunk, warm, after, prefill)
        print(f"{label:>36} {x['slots']:>6} {x['main']:>5} {x['evicted']:>8} {x['first16']:>9.1%} {x['after']:>8.1%}")


# How each converted trace was used while the adaptive policy was designed (bench/routing_logs.md):
# every choice was compared on the tuned ones; the held-out ones were replayed once, at the end.
ROLES = {"mixtral-humaneval": "tuned", "qwen-gsm8k-5layers": "tuned", "mixtral-gsm8k": "tuned",
         "mixtral-humaneval-raw": "tuned", "qwen-gsm8k-layer0": "tuned", "qwen-gptq-gsm8k-layer0": "held out",
         "olmoe-gsm8k-layer0": "held out", "demo": "held out"}
SIZES = "10,20,30,40,50,60,70,80,90"
BARS = {0.3: 0.65, 0.7: 0.85}


def report(name: str, path: Path, fractions: list[float], full: bool = False) -> dict:
    """One trace's table; returns which bars the default policy met."""
    trace = load_trace(path)
    result = simulate(trace, list(ALL_POLICIES), fractions)
    role = ROLES.get(name, "unlabelled")
    print(f"\n=== {name} ({role}): {path}")
    if full:
        print(table(result, list(ALL_POLICIES), per_layer=False))
        return _verdict(result)
    print(f"{result['requests']} requests, {result['n_tokens']} tokens, {len(result['layers'])} layers x "
          f"{result['n_experts']} experts; demand hit rate (% of opt)")
    print(f"{'size':>5} " + " ".join(f"{c:>15}" for c in ALL_POLICIES) + f" {'opt':>6}")
    for row in result["sizes"]:
        r = row["hit_rate"]
        cells = " ".join(f"{r[c]:>6.1%} ({r[c] / r['opt'] if r['opt'] else 0:>5.1%})" for c in ALL_POLICIES)
        print(f"{row['fraction']:>5.0%} {cells} {r['opt']:>6.1%}")
    if "prefetch" not in result["sizes"][0]:
        print("with prefetch: n/a (the trace holds no next-layer predictions)")
    else:
        print(f"with prefetch (predictions: {result['predictions_from']}): hit rate (% of opt's demand hit rate), "
              "MiB copied per token off -> on")
        for row in result["sizes"]:
            cells = []
            for c in ("lru", "lfu", "adaptive"):
                p = row["prefetch"][c]
                cells.append(f"{p['hit_rate']:>6.1%} ({p['hit_rate'] / row['hit_rate']['opt']:>6.1%}) "
                             f"{p['demand_bytes_per_token'] / 2**20:>7.1f} -> {p['bytes_per_token'] / 2**20:>7.1f}")
            print(f"{row['fraction']:>5.0%} " + " | ".join(cells))
        print(f"      (columns: lru | lfu | adaptive; prediction accuracy {result['sizes'][0]['prefetch']['adaptive']['accuracy']:.1%})")
    return _verdict(result)


def _verdict(result: dict) -> dict:
    out = {}
    for row in result["sizes"]:
        r = row["hit_rate"]
        out.setdefault("beats lru and lfu", True)
        if r["adaptive"] + 1e-12 < max(r["lru"], r["lfu"]):
            out["beats lru and lfu"] = False
            print(f"  adaptive below {'lru' if r['lru'] > r['lfu'] else 'lfu'} at {row['fraction']:.0%}: "
                  f"{r['adaptive']:.2%} vs {max(r['lru'], r['lfu']):.2%}")
        bar = BARS.get(round(row["fraction"], 2))
        if bar is not None and r["opt"]:
            ratio = r["adaptive"] / r["opt"]
            out[f"{bar:.0%} of opt at {row['fraction']:.0%}"] = ratio >= bar
            print(f"  adaptive at {row['fraction']:.0%}: {ratio:.1%} of opt ({'meets' if ratio >= bar else 'misses'} "
                  f"the {bar:.0%} bar)")
    print(f"  adaptive >= lru and lfu at every size: {'yes' if out.get('beats lru and lfu') else 'no'}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEMO)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--real", type=Path, default=ROOT / "bench-out" / "routing",
                   help="folder of traces converted from public routing logs (skipped if absent)")
    p.add_argument("--trace", type=Path, help="replay this trace as the demo's instead of collecting one")
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--prefill-reserve", default="4,16", help="slots kept for prefill in part 2, a comma list (0: skip it)")
    p.add_argument("--out", type=Path, default=ROOT / "bench-out", help="where the demo trace and the plot go")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fractions = [float(s.strip().rstrip("%")) / 100 for s in args.sizes.split(",")]
    met = {}
    for path in sorted(args.real.glob("*.npz")) if args.real.is_dir() else []:
        met[path.stem] = report(path.stem, path, fractions)
    trace_path = args.trace
    if trace_path is None:
        if not args.model.exists():
            print(f"{args.model} does not exist: train it with `make demo-model`", file=sys.stderr)
            return 2
        trace_path = args.out / "cache_policy_trace.npz"
        info = collect(args.model, args.tokens, trace_path)
        print(f"\ndemo trace: {info['tokens']} held-out tokens through {args.model.name}, "
              f"next-layer prediction accuracy {info['prefetch_accuracy']:.1%}")
        sim = replay_trace(load_trace(trace_path), "adaptive", info["slots"]).hit_rate
        print(f"the runtime that recorded it (adaptive, prefetch on, --experts-cache {RUNTIME_SIZE} = "
              f"{info['slots']} slots): hit rate {info['hit_rate']:.2%}; the simulator on its trace: {sim:.2%}")
    met["demo"] = report("demo", trace_path, fractions, full=True)
    png = args.out / "cache_policy.png"
    plot(simulate(load_trace(trace_path), list(ALL_POLICIES), fractions), list(ALL_POLICIES), str(png),
         f"expert cache hit rate: {(args.trace or args.model).name}")
    print(f"\nplot: {png}")
    print("\nsummary, adaptive by demand alone:")
    for name, bars in met.items():
        print(f"  {name:>24} ({ROLES.get(name, 'unlabelled')}): " + ", ".join(
            f"{bar} {'met' if ok else 'missed'}" for bar, ok in bars.items()))
    reserves = [int(r) for r in args.prefill_reserve.split(",") if int(r) > 0]
    if reserves and args.trace is None:
        prefill_report(args.model, "30%", reserves)
    return 0 if all(all(b.values()) for b in met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
