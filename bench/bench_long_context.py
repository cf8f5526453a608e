"""Long-context prefill with the attention KV tiered (`--kv-device`) and not, side by side.

Not a test: `python bench/bench_long_context.py [--tokens 32768] [--kv-device 16M] [--threads 2]`.

The model is the demo model `strata/demo/strata-demo.gguf` (qwen3moe, 8 layers, 2 KV heads of
32, trained on 512-token contexts) loaded with ctx_size=32768: the rope simply extrapolates
past 512 positions, so the text it would generate there means nothing; what is measured is the
cost of the KV, which does not depend on the weights. The prompt is random token ids.

Each mode runs in its own process (peak RSS is per process): a chunked prefill
(`--prefill-chunk`, default 2048, which bounds the attention's score matrix), timed; then
prefill tokens/s, the process's peak RSS, the device KV bytes (tiered: the layers' block pools;
untiered: the whole `KVCache`, which lives on the device) and the host KV bytes. The last
position's logits of the two runs are compared.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "strata" / "demo" / "strata-demo.gguf"


def run_one(args) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import strata
    from strata.models.kv_tiers import model_device_bytes
    from strata.runtime.generate import prefill

    torch.set_num_threads(args.threads)
    opts = dict(ctx_size=32768, prefill_chunk=args.prefill_chunk)
    if args.mode == "tiered":
        opts["kv_device_budget"] = args.kv_device
    engine = strata.load(MODEL, **opts)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, engine.config.vocab_size, (args.tokens,), generator=g).tolist()
    cache = engine.model.new_cache(1)
    t0 = time.perf_counter()
    with torch.inference_mode():
        last = prefill(engine.model, [ids], cache, args.prefill_chunk)
    dt = time.perf_counter() - t0
    tiered = args.mode == "tiered"
    device = model_device_bytes(cache) if tiered else cache.nbytes
    host = sum(getattr(c, "host_bytes", 0) for c in cache.layers) if tiered else 0
    copies = sum(getattr(c, "copies", 0) for c in cache.layers)
    torch.save(last, args.out)
    return {"mode": args.mode, "tokens": args.tokens, "prefill_s": dt, "prefill_tok_s": args.tokens / dt,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "device_kv_bytes": device, "host_kv_bytes": host, "block_copies": copies}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--kv-device", default="16M")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mode", choices=["plain", "tiered"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_one(args)))
        return 0
    print(f"model {MODEL.name}: trained context 512, run at ctx_size 32768 (rope extrapolates; "
          f"the outputs mean nothing, the KV costs are real)")
    print(f"prompt {args.tokens} random tokens, prefill chunk {args.prefill_chunk}, "
          f"{args.threads} threads, --kv-device {args.kv_device}")
    import tempfile

    import torch

    results = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("plain", "tiered"):
            out = Path(d) / f"{mode}.pt"
            cmd = [sys.executable, __file__, "--mode", mode, "--out", str(out), "--tokens", str(args.tokens),
                   "--kv-device", args.kv_device, "--prefill-chunk", str(args.prefill_chunk),
                   "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr, file=sys.stderr)
                return 1
            results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode]["logits"] = torch.load(out)
    diff = (results["plain"]["logits"] - results["tiered"]["logits"]).abs().max().item()
    rows = [("prefill tokens/s", "prefill_tok_s", "{:.1f}"), ("prefill s", "prefill_s", "{:.1f}"),
            ("peak RSS MiB", "peak_rss_mb", "{:.0f}"),
            ("device KV MiB", "device_kv_bytes", lambda b: f"{b / 2**20:.2f}"),
            ("host KV MiB", "host_kv_bytes", lambda b: f"{b / 2**20:.2f}"),
            ("blocks copied in", "block_copies", "{}")]
    print(f"{'':20s} {'untiered':>12s} {'tiered':>12s}")
    for name, key, fmt in rows:
        f = fmt.format if isinstance(fmt, str) else fmt
        print(f"{name:20s} {f(results['plain'][key]):>12s} {f(results['tiered'][key]):>12s}")
    print(f"last-position logits, max |untiered - tiered| = {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
