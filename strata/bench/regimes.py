"""The four regimes the source report says change the conclusion, plus prefill speed.

Each function takes a loaded engine (cold start excepted) and returns plain numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from strata.runtime.sampling import SamplingParams

COLD_START = r'''
import json, os, sys, time
t0 = float(sys.argv[2])
import strata
e = strata.load(sys.argv[1], **json.loads(sys.argv[3]))
t_loaded = time.time()
ids = e.tokenizer.encode(sys.argv[4])
next(iter(e.stream(ids, 1)))
print(json.dumps({"load_s": t_loaded - t0, "first_token_s": time.time() - t0}))
'''


class HitRate:
    """The expert cache's hit rate over one regime (the tiers count from load on)."""

    def __init__(self, engine):
        self.engine = engine
        self.start = self._counts()

    def _counts(self) -> tuple[int, int]:
        total = (self.engine.stats.get("tiers") or {}).get("total") or {}
        return total.get("hits", 0), total.get("misses", 0)

    def rate(self) -> float | None:
        """None when the tiers are off (every expert resident)."""
        if getattr(self.engine, "tiers", None) is None:
            return None
        if hasattr(self.engine.tiers, "stats"):
            self.engine.stats["tiers"] = self.engine.tiers.stats()
        hits, misses = (b - a for a, b in zip(self.start, self._counts()))
        return hits / (hits + misses) if hits + misses else None


def drop_page_cache(path: str) -> bool:
    """Ask the kernel to forget the file's cached pages (clean pages; no root needed)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def cold_start(model: str, options: dict, prompt: str, page_cache: str) -> dict:
    """A fresh process to its first token; `page_cache` is "dropped" or "warm"."""
    dropped = drop_page_cache(model) if page_cache == "dropped" else False
    out = subprocess.run([sys.executable, "-c", COLD_START, model, repr(time.time()), json.dumps(options), prompt],
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["page_cache"] = "dropped (posix_fadvise DONTNEED)" if dropped else "warm"
    return result


def serial_warm(engine, ids: list[int], runs: int = 9, tokens: int = 256) -> dict:
    """The report's method: warm engine, serial greedy runs, fixed output length."""
    engine.generate(ids, 8, stop_at_eos=False)  # warm-up, not counted
    speeds, hits = [], HitRate(engine)
    for _ in range(runs):
        engine.generate(ids, tokens, stop_at_eos=False)
        speeds.append(engine.stats["decode_tokens_per_s"])
    return {"runs": runs, "tokens": tokens, "median_tps": statistics.median(speeds), "min_tps": min(speeds),
            "max_tps": max(speeds), "hit_rate": hits.rate()}


def concurrency(engine, prompts: list[list[int]], levels=(1, 2, 4, 8), tokens: int = 128) -> list[dict]:
    """N simultaneous requests through the continuous-batching scheduler."""
    from strata.runtime.scheduler import Scheduler

    rows = []
    for n in levels:
        hits = HitRate(engine)
        with Scheduler(engine, max_concurrent=n) as sched:
            t0 = time.perf_counter()
            reqs = [sched.submit(prompts[i % len(prompts)], tokens, SamplingParams(), ignore_eos=True)
                    for i in range(n)]
            for r in reqs:
                for _ in r:
                    pass
            wall = time.perf_counter() - t0
        ttft = sorted(r.first_token_at - r.submitted_at for r in reqs)
        per_req = [r.completion_tokens / (r.finished_at - r.submitted_at) for r in reqs]
        rows.append({"concurrency": n, "aggregate_tps": sum(r.completion_tokens for r in reqs) / wall,
                     "per_request_tps": statistics.median(per_req), "ttft_p50_s": _pct(ttft, 50),
                     "ttft_p95_s": _pct(ttft, 95), "hit_rate": hits.rate()})
    return rows


def long_output(engine, ids: list[int], tokens: int = 2048, window: int = 256) -> dict:
    """One long greedy generation; speed per window shows drift as the context grows."""
    stamps, hits = [], HitRate(engine)
    for r in engine.stream(ids, tokens, stop_at_eos=False):
        if r.token is not None:
            stamps.append(time.perf_counter())
    windows = [window / (stamps[i + window - 1] - stamps[i - 1]) for i in range(1, len(stamps) - window + 1, window)]
    return {"tokens": len(stamps), "window": window, "tps_per_window": windows, "hit_rate": hits.rate()}


def prefill_speed(engine, vocab_ids: list[int], lengths=(512, 4096, 32768)) -> list[dict]:
    rows = []
    for n in lengths:
        if n > engine.ctx_size:
            rows.append({"tokens": n, "skipped": f"context is {engine.ctx_size}"})
            continue
        ids = (vocab_ids * (n // len(vocab_ids) + 1))[:n]
        hits, t0 = HitRate(engine), time.perf_counter()
        engine.generate(ids, 1, stop_at_eos=False)
        rows.append({"tokens": n, "tps": n / (time.perf_counter() - t0), "hit_rate": hits.rate()})
    return rows


def _pct(sorted_values: list[float], p: float) -> float:
    k = (len(sorted_values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)
