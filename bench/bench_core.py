"""Decode speed and peak RSS: Strata vs transformers' `generate`, same prompt, same threads.

Each run is a fresh process (peak RSS is per process). Prints medians of --repeats runs and
the ratio side by side. Not a test: `python bench/bench_core.py [--threads 2]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = 'def read_config(path):\n    """Read a JSON config file and return a dict."""\n'

WORKER = r'''
import json, resource, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
kind, path, n_new = sys.argv[1], sys.argv[2], int(sys.argv[4])
prompt = sys.argv[5]
if kind == "strata":
    import strata
    e = strata.load(path)
    ids = e.tokenizer.encode(prompt)
    e.generate(ids, 4, stop_at_eos=False)  # warm-up
    e.generate(ids, n_new, stop_at_eos=False)
    tps = e.stats["decode_tokens_per_s"]
else:
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
    x = tok(prompt, return_tensors="pt").input_ids
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        m.generate(x, max_new_tokens=4, min_new_tokens=4, **kw)
        t0 = time.perf_counter(); m.generate(x, max_new_tokens=1, min_new_tokens=1, **kw); t1 = time.perf_counter()
        m.generate(x, max_new_tokens=n_new, min_new_tokens=n_new, **kw); t2 = time.perf_counter()
    tps = (n_new - 1) / ((t2 - t1) - (t1 - t0))  # decode only: subtract the prefill + first token
print(json.dumps({"tps": tps, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def run(kind: str, path: Path, threads: int, n_new: int) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, kind, str(path), str(threads), str(n_new), PROMPT],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from smollm2 import smollm2_gguf_path

    models = {"demo (qwen3moe 8x32)": ROOT / "strata/demo/strata-demo.gguf",
              "SmolLM2-135M Q4_1": smollm2_gguf_path()}
    print(f"decode {args.tokens} tokens greedy, {args.threads} threads, median of {args.repeats} fresh processes")
    print(f"{'model':<22} {'strata tok/s':>12} {'hf tok/s':>10} {'ratio':>6} {'strata RSS':>11} {'hf RSS':>8}")
    for name, path in models.items():
        if path is None or not Path(path).exists():
            print(f"{name:<22} (missing)")
            continue
        s = [run("strata", path, args.threads, args.tokens) for _ in range(args.repeats)]
        try:
            h = [run("hf", path, args.threads, args.tokens) for _ in range(args.repeats)]
        except subprocess.CalledProcessError as e:  # transformers cannot load this architecture from GGUF
            h = None
            reason = e.stderr.strip().splitlines()[-1][:60]
        st, sr = statistics.median(r["tps"] for r in s), statistics.median(r["rss_mb"] for r in s)
        if h:
            ht, hr = statistics.median(r["tps"] for r in h), statistics.median(r["rss_mb"] for r in h)
            print(f"{name:<22} {st:>12.1f} {ht:>10.1f} {st / ht:>5.2f}x {sr:>9.0f}MB {hr:>6.0f}MB")
        else:
            print(f"{name:<22} {st:>12.1f} {'n/a':>10} {'':>6} {sr:>9.0f}MB   (transformers: {reason})")


if __name__ == "__main__":
    main()
