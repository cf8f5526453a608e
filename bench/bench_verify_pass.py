"""A speculative verify pass of B positions (or a decode batch of B rows) against B one-token steps,
with the multi-row q8x2 kernels on and off, CPU ms side by side.

    .venv/bin/python bench/bench_verify_pass.py --model FILE.gguf [--threads 1] [--rows 2 4 8 17]
                                                [--repeats 5] [--steps 6] [--batch]

Each case starts from a fresh cache after a 16-token prompt (experts resident):
  steps      B one-token forwards (the decode path: one C call per token where the model has it);
  verify     one forward of B new positions with the cache tracking (`cache.track()`), all B
             positions' logits, then `rollback` of them, as the MTP loop runs it (B <= 17, the
             verify cap ROWS_NEW_MAX); with --batch instead B sequences one token each.
The verify pass runs twice, the multi-row kernels on (each weight block unpacked once for all B
rows) and off (each row its one-row kernel); the three alternate in one process, --repeats times,
so all see the same background load. Per case: the process's CPU time (all threads) per pass,
medians over --steps passes and then over repeats; ratios are to the B one-token steps. The verify
pass's logits are checked bit-equal with the kernels on and off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import strata  # noqa: E402
from strata.kernels import _build  # noqa: E402

PROMPT = 16


def fresh(model, rows: int, g: torch.Generator):
    """A cache after a PROMPT-token prompt per row."""
    cache = model.new_cache(rows)
    model(torch.randint(10, model.config.vocab_size, (rows, PROMPT), generator=g), cache, last_only=True)
    return cache


def one_pass(model, kind: str, B: int, batch: bool, g: torch.Generator) -> tuple[float, torch.Tensor | None]:
    """(CPU s, logits) of one pass from fresh caches (their prompts not timed)."""
    vocab = model.config.vocab_size
    if kind == "steps":  # B one-token forwards: one sequence's B tokens, or B sequences' one each
        caches = [fresh(model, 1, g) for _ in range(B if batch else 1)]
        tokens = torch.randint(10, vocab, (B, 1), generator=g)
        c = time.process_time()
        for j in range(B):
            model(tokens[j:j + 1], caches[j if batch else 0], last_only=True)
        return time.process_time() - c, None
    cache = fresh(model, B if batch else 1, g)
    if not batch:
        cache.track()  # what a verify pass keeps for its rollback
    tokens = torch.randint(10, vocab, (B, 1) if batch else (1, B), generator=g)
    c = time.process_time()
    logits = model(tokens, cache, last_only=batch)
    if not batch:
        cache.rollback(B - 1)  # the drafts rejected
    return time.process_time() - c, logits


def measure(model, kind: str, B: int, batch: bool, steps: int, seed: int) -> tuple[float, torch.Tensor | None]:
    """(median CPU s per pass, the last pass's logits) over `steps` passes after a warm-up one."""
    g = torch.Generator().manual_seed(seed)
    runs = [one_pass(model, kind, B, batch, g) for _ in range(steps + 1)][1:]
    return statistics.median(t for t, _ in runs), runs[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 17])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="passes per measurement")
    ap.add_argument("--batch", action="store_true", help="decode batches of B sequences instead of verify passes")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = strata.load(a.model, draft="off", cpu_threads=a.threads).model
    lib = _build.load()
    load = os.getloadavg()
    what = "decode batch of B rows" if a.batch else "verify pass of B positions"
    print(f"{Path(a.model).name}: {what} vs B one-token steps, {a.threads} thread(s), {a.repeats} alternating "
          f"repeats of {a.steps} passes, load {load[0]:.1f} {load[1]:.1f}")
    print(f"{'B':>3} | {'B steps CPU ms':>14} | {'multi-row off ms':>16} {'ratio':>6} | {'on ms':>8} {'ratio':>6} | on / off")
    with torch.inference_mode():
        for B in a.rows:
            got = {"steps": [], "off": [], "on": []}
            for r in range(a.repeats):
                order = ["steps", "off", "on"] if r % 2 == 0 else ["on", "off", "steps"]
                logits = {}
                for mode in order:
                    lib.strata_set_multirow(0 if mode == "off" else 1)
                    t, logits[mode] = measure(model, mode, B, a.batch, a.steps, seed=r)
                    got[mode].append(t)
                lib.strata_set_multirow(1)
                if not torch.equal(logits["on"], logits["off"]):
                    raise SystemExit(f"B={B}: the verify logits differ with the multi-row kernels on and off")
            med = {k: statistics.median(v) * 1e3 for k, v in got.items()}
            print(f"{B:>3} | {med['steps']:14.2f} | {med['off']:16.2f} {med['off'] / med['steps']:6.2f} | "
                  f"{med['on']:8.2f} {med['on'] / med['steps']:6.2f} | {med['on'] / med['off']:.2f}", flush=True)
    load = os.getloadavg()
    print(f"load after: {load[0]:.1f} {load[1]:.1f}")


if __name__ == "__main__":
    main()
