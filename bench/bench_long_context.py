"""Long-context prefill and decode with the attention KV tiered (`--kv-device`) and not, side by side.

Not a test: `python bench/bench_long_context.py [--tokens 32768] [--kv-device 16M] [--threads 2]
[--decode-at 8192,32768] [--decode-tokens 32]`.

The model is the demo model `strata/demo/strata-demo.gguf` (whatever architecture it has today)
loaded with ctx_size=32768: it was trained on short contexts and the rope simply extrapolates
past them, so the text it would generate there means nothing; what is measured is the cost of
the KV, which does not depend on the weights. The prompt is random token ids.

Each mode runs in its own process (peak RSS is per process). The prompt is prefilled in chunks
(`--prefill-chunk`, default 2048, which bounds the attention's score matrix), timed; when the
context reaches each `--decode-at` length, `--decode-tokens` decode steps run (one token each,
fixed random ids, so both modes see the same input; the tokens stay in the context), each timed
alone, and the median step gives decode tokens/s. Then: prefill tokens/s, the process's peak
RSS, the device KV bytes (tiered: the layers' block pools; untiered: the whole `KVCache`, which
lives on the device) and the host KV bytes. The last decode step's logits of the two runs are
compared.

On a machine shared with other work prefer `--threads 1`: with 2 threads every multi-threaded
kernel call can wait a whole time slice for a descheduled thread, and the figures then count
fork-join points more than work.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "strata" / "demo" / "strata-demo.gguf"


def decode_tok_s(model, cache, tokens: list[int]) -> tuple[float, object]:
    """Median decode tokens/s over one-token steps feeding `tokens`; and the last step's logits."""
    import torch

    times, logits = [], None
    for tok in tokens:
        t0 = time.perf_counter()
        logits = model(torch.tensor([[tok]]), cache, last_only=True)[:, 0]
        times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times), logits


def run_one(args) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import strata
    from strata.tiers.kv_tiers import model_device_bytes
    from strata.runtime.generate import prefill

    torch.set_num_threads(args.threads)
    opts = {"ctx_size": 32768, "prefill_chunk": args.prefill_chunk}
    if args.mode == "tiered":
        opts["kv_device_budget"] = args.kv_device
    engine = strata.load(MODEL, **opts)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.config.vocab_size, (args.tokens,), generator=g).tolist()
    steps = torch.randint(0, engine.config.vocab_size, (args.decode_tokens,), generator=g).tolist()
    points = [p for p in args.decode_at if p <= args.tokens]
    cache = engine.model.new_cache(1)
    prefill_s, decode, done, last = 0.0, {}, 0, None
    with torch.inference_mode():
        for end in sorted(set(points) | {args.tokens}):
            t0 = time.perf_counter()
            last = prefill(engine.model, [ids[done:end]], cache, args.prefill_chunk)
            prefill_s += time.perf_counter() - t0
            done = end
            if end in points and args.decode_tokens:
                decode[end], last = decode_tok_s(engine.model, cache, steps)
    tiered = args.mode == "tiered"
    device = model_device_bytes(cache) if tiered else cache.nbytes
    host = sum(getattr(c, "host_bytes", 0) for c in cache.layers) if tiered else 0
    copies = sum(getattr(c, "copies", 0) for c in cache.layers)
    torch.save(last, args.out)
    result = {"mode": args.mode, "tokens": args.tokens, "prefill_s": prefill_s,
              "prefill_tok_s": args.tokens / prefill_s,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "device_kv_bytes": device, "host_kv_bytes": host, "block_copies": copies}
    result.update({f"decode_tok_s@{p}": s for p, s in decode.items()})
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--kv-device", default="16M")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-at", type=lambda s: [int(x) for x in s.split(",") if x], default=[8192, 32768],
                   help="context lengths where decode is timed (comma-separated)")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed at each length")
    p.add_argument("--mode", choices=["plain", "tiered"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_one(args)))
        return 0
    print(f"model {MODEL.name} run at ctx_size 32768 (rope extrapolates past its training context; "
          f"the outputs mean nothing, the KV costs are real)")
    print(f"prompt {args.tokens} random tokens, prefill chunk {args.prefill_chunk}, {args.threads} threads, "
          f"--kv-device {args.kv_device}, {args.decode_tokens} decode steps at each of {args.decode_at}")
    import tempfile

    import torch

    results = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("plain", "tiered"):
            out = Path(d) / f"{mode}.pt"
            cmd = [sys.executable, __file__, "--mode", mode, "--out", str(out), "--tokens", str(args.tokens),
                   "--kv-device", args.kv_device, "--prefill-chunk", str(args.prefill_chunk),
                   "--threads", str(args.threads), "--decode-at", ",".join(map(str, args.decode_at)),
                   "--decode-tokens", str(args.decode_tokens)]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr, file=sys.stderr)
                return 1
            results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode]["logits"] = torch.load(out)
    diff = (results["plain"]["logits"] - results["tiered"]["logits"]).abs().max().item()
    rows = [("prefill tokens/s", "prefill_tok_s", "{:.1f}"), ("prefill s", "prefill_s", "{:.1f}")]
    rows += [(f"decode tokens/s @{p}", f"decode_tok_s@{p}", "{:.1f}") for p in args.decode_at
             if f"decode_tok_s@{p}" in results["plain"]]
    rows += [("peak RSS MiB", "peak_rss_mb", "{:.0f}"),
             ("device KV MiB", "device_kv_bytes", lambda b: f"{b / 2**20:.2f}"),
             ("host KV MiB", "host_kv_bytes", lambda b: f"{b / 2**20:.2f}"),
             ("blocks copied in", "block_copies", "{}")]
    print(f"{'':22s} {'untiered':>12s} {'tiered':>12s} {'tiered/untiered':>16s}")
    for name, key, fmt in rows:
        f = fmt.format if isinstance(fmt, str) else fmt
        plain, tiered = results["plain"][key], results["tiered"][key]
        ratio = f"{tiered / plain:.2f}" if plain else "-"
        print(f"{name:22s} {f(plain):>12s} {f(tiered):>12s} {ratio:>16s}")
    print(f"last decode step's logits, max |untiered - tiered| = {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
