"""The Gated DeltaNet decode half in C against its torch form, on the passes it serves, one table.

    .venv/bin/python bench/bench_deltanet_decode.py --model FILE.gguf [--threads 1] [--repeats 5]

FILE: a qwen3next or qwen4exp GGUF with quantized DeltaNet projections, e.g. `strata synth --like
qwen3-next-80b --layers 4` or `strata synth --like qwen4exp --layers 4 --quant IQ2_XS --vocab 32768
--experts 64` (the flagship's layer shapes, 3 DeltaNet layers and 1 attention layer).

Passes (each on a fresh cache after a 16-token prompt per row, experts resident):
  decode B=n   n sequences, one token each per pass (a decode batch; n = 1 is plain decoding);
  verify k=K   one sequence, a speculative verify pass of K+1 positions with the cache tracking,
               then `rollback` of 0..K drafts (cycling), as the MTP loop runs it.
The two modes alternate in one process, --repeats times, so both see the same background load:
  torch  the DeltaNet half in torch operators (decode_ops.try_gdn_block / try_gdn_mixer declined:
         what these passes ran before the C half took them);
  C      the one C call per DeltaNet layer and pass.
Per pass: the process's CPU time (all threads) and wall time, medians over --steps passes and
then over repeats, divided by the tokens the pass feeds (n, or K+1); and the torch operators per
token (every aten:: event under the profiler, nested ones included, in one further pass).
The whole forward is timed: attention, MoE, head included, so the difference is the DeltaNet half's.
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
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import strata  # noqa: E402
from strata.kernels import decode_ops  # noqa: E402

PROMPT = 16
_C = (decode_ops.try_gdn_block, decode_ops.try_gdn_mixer)


def set_mode(c: bool) -> None:
    decode_ops.try_gdn_block, decode_ops.try_gdn_mixer = _C if c else ((lambda *a: None),) * 2


def passes(model, kind: str, n: int, steps: int, seed: int):
    """A fresh cache after the prompt; yields one callable per pass (the pass, its rollback)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    rows = n if kind == "decode" else 1
    cache = model.new_cache(rows)
    model(torch.randint(10, vocab, (rows, PROMPT), generator=g), cache, last_only=True)
    if kind == "verify":
        cache.track()
    for i in range(steps):
        width = 1 if kind == "decode" else n + 1
        tokens = torch.randint(10, vocab, (rows, width), generator=g)

        def one(tokens=tokens, drop=i % width):
            model(tokens, cache, last_only=kind == "decode")
            if kind == "verify":
                cache.rollback(drop)
        yield one


def measure(model, kind: str, n: int, steps: int, seed: int) -> tuple[float, float]:
    """(median CPU s, median wall s) per pass."""
    cpu, wall = [], []
    for i, one in enumerate(passes(model, kind, n, steps + 1, seed)):
        c, w = time.process_time(), time.perf_counter()
        one()
        if i:  # the first pass warms the cache's buffers
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def torch_ops(model, kind: str, n: int, seed: int) -> int:
    it = passes(model, kind, n, 2, seed)
    next(it)()
    one = next(it)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="passes per measurement")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--drafts", type=int, nargs="+", default=[2, 3], help="K of the verify passes")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = strata.load(a.model, draft="off").model
    cases = [("decode", b) for b in a.batches] + [("verify", k) for k in a.drafts]
    load = os.getloadavg()
    print(f"{Path(a.model).name}: {a.threads} thread(s), {a.repeats} alternating repeats of {a.steps} passes, "
          f"load {load[0]:.1f} {load[1]:.1f}")
    print(f"{'pass':<12} {'tok':>3} | {'CPU ms/token torch':>18} {'C':>8} {'ratio':>6} | "
          f"{'wall ms/token torch':>19} {'C':>8} | {'torch ops/token torch':>21} {'C':>6}")
    with torch.inference_mode():
        for kind, n in cases:
            tokens = n if kind == "decode" else n + 1
            got = {True: [], False: []}
            for r in range(a.repeats):
                for c in (False, True) if r % 2 == 0 else (True, False):
                    set_mode(c)
                    got[c].append(measure(model, kind, n, a.steps, seed=r))
            ops = {}
            for c in (False, True):
                set_mode(c)
                ops[c] = torch_ops(model, kind, n, seed=0)
            set_mode(True)
            med = {c: [statistics.median(v[i] for v in got[c]) * 1e3 / tokens for i in (0, 1)] for c in got}
            ratios = statistics.median(t[0] / c[0] for t, c in zip(got[False], got[True]))  # same-repeat pairs
            label = f"{kind} {'B' if kind == 'decode' else 'k'}={n}"
            print(f"{label:<12} {tokens:>3} | {med[False][0]:18.2f} {med[True][0]:8.2f} {ratios:5.2f}x | "
                  f"{med[False][1]:19.2f} {med[True][1]:8.2f} | {ops[False] / tokens:21.0f} {ops[True] / tokens:6.0f}")
    load = os.getloadavg()
    print(f"load after: {load[0]:.1f} {load[1]:.1f}; ratio: torch CPU / C CPU, median of same-repeat pairs")


if __name__ == "__main__":
    main()
