"""Soak: many requests at fixed concurrency against a real `strata serve` process (not a test).

    .venv/bin/python bench/soak_server.py [--model strata/demo/strata-demo.gguf] [--requests 1000]
        [--concurrency 8] [--max-tokens 24] [--drafts on,off] [--threads 1]

For each `--drafts` setting (the server's `--draft`: MTP drafts on or off) a fresh server runs:
first each distinct prompt is served alone (the serial reference), then all requests run through a
pool of `--concurrency` client threads (with drafts on, every row of the batch drafts); every
output is compared with its serial reference, and the serial outputs of every setting with each
other (greedy: drafts must not change the text, except where the top two logits tie within the
batched products' rounding, see tests/test_serve_drafts.py). Prints errors, mismatches,
completion tokens/s of both phases per setting side by side, and the server's RSS over time.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"def {name}(path):\n    " for name in
           ("read_config", "load", "parse_args", "main", "walk", "copy_tree", "open_text", "checksum",
            "split_lines", "merge", "to_json", "from_json", "retry", "connect", "close", "flush")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def soak(args, draft: str) -> dict:
    """One server with `--draft draft`: serial then concurrent phase."""
    import httpx
    from openai import OpenAI

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "strata.cli", "serve", "--model", args.model,
                               "--port", str(port), "--max-concurrent", str(args.concurrency),
                               "--model-name", "demo", "--log-level", "warning", "--draft", draft,
                               "--cpu-threads", str(args.threads)])
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or server.poll() is not None:
                sys.exit("the server did not start")
            time.sleep(0.2)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(prompt: str) -> tuple[str, int]:
            r = client.completions.create(model="demo", prompt=prompt, max_tokens=args.max_tokens, temperature=0)
            return r.choices[0].text, r.usage.completion_tokens

        t0 = time.perf_counter()
        serial_runs = {prompt: ask(prompt) for prompt in PROMPTS}
        serial_s = time.perf_counter() - t0
        serial = {p: text for p, (text, _) in serial_runs.items()}
        serial_tokens = sum(n for _, n in serial_runs.values())
        rss = [(0, rss_mb(server.pid))]
        errors, mismatches, done, tokens = [], 0, 0, 0
        t0 = time.perf_counter()

        def one(i: int):
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                return (prompt, *ask(prompt), None)
            except Exception as e:  # counted, never raised: the soak reports every failure
                return prompt, None, 0, repr(e)

        with ThreadPoolExecutor(args.concurrency) as pool:
            for prompt, text, n, err in pool.map(one, range(args.requests)):
                done += 1
                tokens += n
                if err:
                    errors.append(err)
                elif text != serial[prompt]:
                    mismatches += 1
                if done % 100 == 0:
                    rss.append((done, rss_mb(server.pid)))
        wall = time.perf_counter() - t0
        draft = {line.split()[0][len("strata_draft_"):]: float(line.split()[1])
                 for line in httpx.get(f"{base}/metrics").text.splitlines() if line.startswith("strata_draft_")}
    finally:
        server.terminate()
        server.wait(30)
    return {"serial": serial, "serial_tok_s": serial_tokens / serial_s, "tok_s": tokens / wall,
            "req_s": args.requests / wall, "wall": wall, "errors": errors, "mismatches": mismatches, "rss": rss,
            "draft": draft}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(ROOT / "strata/demo/strata-demo.gguf"))
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--drafts", default="on,off", help="server --draft settings to run, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="the server's --cpu-threads")
    args = p.parse_args()
    runs = {d: soak(args, d) for d in args.drafts.split(",")}
    print(f"{args.requests} requests, concurrency {args.concurrency}, {args.max_tokens} max tokens, greedy, "
          f"{args.threads} server thread(s); load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'--draft':>8} {'serial tok/s':>13} {'concurrent tok/s':>17} {'requests/s':>11} {'errors':>7} "
          f"{'mismatches':>11}")
    for d, r in runs.items():
        print(f"{d:>8} {r['serial_tok_s']:13.1f} {r['tok_s']:17.1f} {r['req_s']:11.2f} {len(r['errors']):7d} "
              f"{r['mismatches']:11d}")
    for d, r in runs.items():
        c = r["draft"]
        if c:  # both phases, from the server's /metrics
            print(f"--draft {d}: {c['accepted_tokens_total'] / max(c['tokens_total'], 1):.1%} of "
                  f"{c['tokens_total']:.0f} drafts accepted; {c['rounds_total'] / max(c['passes_total'], 1):.2f} "
                  f"rows per verify pass; {(c['rounds_total'] + c['accepted_tokens_total']) / max(c['rounds_total'], 1):.2f}"
                  " tokens per row round")
    if {"on", "off"} <= set(runs):
        on, off = runs["on"], runs["off"]
        same = sum(on["serial"][p] == off["serial"][p] for p in PROMPTS)
        print(f"drafts on / off: serial {on['serial_tok_s'] / off['serial_tok_s']:.2f}x, "
              f"concurrent {on['tok_s'] / off['tok_s']:.2f}x; serial outputs equal: {same}/{len(PROMPTS)}")
    for d, r in runs.items():
        print(f"--draft {d}: server RSS (MB) after N requests: " + ", ".join(f"{n}: {m:.0f}" for n, m in r["rss"]))
        later = [m for n, m in r["rss"][2:]]
        if later:
            print(f"  RSS from request 200 on: min {min(later):.0f}, max {max(later):.0f}, "
                  f"median {statistics.median(later):.0f} MB")
        for e in r["errors"][:5]:
            print("  error:", e)


if __name__ == "__main__":
    main()
