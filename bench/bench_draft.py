"""MTP speculative decoding: acceptance rate and decode tokens/s, drafts on vs off, side by side.

Not a test: `python bench/bench_draft.py [--model strata/demo/strata-demo.gguf] [--threads 1]
[--tokens 64] [--prompts 3] [--k 1 2 3 4]`, or `--tiny` for the random model below.

By default the model is the bundled demo (a tiny qwen4exp whose MTP layer was trained against the
model's own outputs, `strata/demo/train.py`) on held-out standard-library code: its real head, its
real acceptance. Every run's tokens are checked equal to `--draft off`'s.

With `--tiny` the model is the tiny random qwen3next of tests/test_qwen3next.py (hidden 64, 4 layers: 2
Gated DeltaNet + 2 gated attention, 8 experts top-2 + a shared expert, vocab 256), fp32, one
sequence, greedy. Its MTP layer (one full-attention block with its own MoE, as Qwen3-Next's)
is loaded by Strata from `mtp.*` safetensors like a real checkpoint's, and every run goes
through the real speculative loop (draft with the head, one verify pass, rollback of the KV
caches and DeltaNet states). Every run's tokens are checked equal to `--draft off`'s.

The heads:

  random     the MTP layer with its random weights: it essentially never agrees, so this is
             the price of drafting with no benefit;
  copied@A   the same MTP layer runs (its compute and KV cache, so drafting costs what it
             costs), but the token it proposes is the model's own greedy continuation, known in
             advance from the `--draft off` run: an MTP head that copies the model. At A < 100 %
             each position of the continuation is, independently with probability 1 - A, drafted
             wrong instead, so a draft is accepted with probability A (a real Qwen3-Next head's
             first-token acceptance is reported around 80-90 %).

No head is trained here: a random model's greedy continuation is unpredictable (no repeats, no
structure), and distilling the one-block head to agree with it reached ~2 % held-out agreement
while memorising its training set, which would measure nothing.

Timing: each drafted run is paired with a `--draft off` run of the same prompt right before it,
and the speedup is the median of those pairs' ratios (the machine this was written on is shared,
so rates drift). A tiny model on a CPU is dominated by per-layer Python overhead rather than by
reading weights, so a verify pass over k+1 tokens costs little more than one decode step (as
for a large memory-bound model), while the head costs a whole block, 1/4 of this model (1/48
of Qwen3-Next-80B's): drafting is relatively dearer here than on a real model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import strata  # noqa: E402
from reference import prompt, save_hf  # noqa: E402
from test_qwen3next import VOCAB, tiny_qwen3next  # noqa: E402
from test_speculative import tiny_mtp  # noqa: E402


class Copied:
    """Runs the real head (its cost, its KV cache) but drafts the model's known greedy tokens,
    each sequence position drafted wrong with probability 1 - alpha (fixed per position)."""

    def __init__(self, head, seq, alpha=1.0, seed=0):
        self.head, self.seq = head, seq
        self.wrong = {s for s in range(len(seq)) if random.Random(seed * 100003 + s).random() >= alpha}

    def new_cache(self, batch=1):
        return self.head.new_cache(batch)

    def __call__(self, tokens, hidden, cache, n_new=None, last_only=False):
        start = int(cache.lengths[0])
        logits, g = self.head(tokens, hidden, cache, n_new, last_only)
        first = start + tokens.shape[1] - logits.shape[1]
        logits = torch.full_like(logits, -1e9)
        for i in range(logits.shape[1]):
            s = first + i + 2  # position p predicts x_{p+2}
            t = self.seq[s] if s < len(self.seq) else 0
            logits[0, i, (t + 1) % VOCAB if s in self.wrong else t] = 0.0
        return logits, g


def run(engine, ids, n, head=None, k=2):
    engine.drafting = head is not None
    if head is not None:
        engine.drafter = head
        engine.options.draft_tokens = k
    out = engine.generate(ids, n, stop_at_eos=False)
    return out, engine.stats["decode_tokens_per_s"], engine.stats.get("draft")


def pairs(engine, ids, n, head, k, repeats):
    """`repeats` (off, on) runs of one prompt back to back -> (ratios, off rates, on rates, same, draft stats)."""
    plain = None
    ratios, offs, ons, same, first = [], [], [], True, None
    for _ in range(repeats):
        out_off, off, _ = run(engine, ids, n)
        out, on, d = run(engine, ids, n, head, k)
        plain = plain or out_off
        same &= out == plain
        ratios.append(on / off)
        offs.append(off)
        ons.append(on)
        first = first or d
    return ratios, offs, ons, same, first


def bench_model(path: Path, args) -> None:
    """The file's own MTP head on held-out code: acceptance and decode speed, drafts on vs off."""
    from strata.demo.train import held_out_tokens

    engine = strata.load(path, draft="on")
    head = engine.drafter
    ids = held_out_tokens(engine.tokenizer.encode, 4000)
    prompts = [ids[i * 1000:i * 1000 + args.prompt_tokens] for i in range(args.prompts)]
    run(engine, prompts[0], 8, head)  # warm-up
    print(f"{path.name}: {engine.loaded.arch.ARCH}, {engine.config.n_layers} layers + MTP, {args.threads} thread(s), "
          f"greedy, {args.tokens} new tokens after {args.prompt_tokens}-token held-out prompts, {args.prompts} prompts "
          f"x {args.repeats} runs, each paired with a --draft off run")
    print(f"{'k':>2} {'accepted':>8} {'by position':>18} {'tok/pass':>8} {'off tok/s':>9} {'on tok/s':>9} "
          f"{'speedup':>8}  same tokens")
    for k in args.k:
        ratios, off_rates, on_rates, same = [], [], [], True
        accepted = drafted = rounds = emitted = 0
        by_pos = [0.0] * k
        for ids in prompts:
            r, off, on, ok, d = pairs(engine, ids, args.tokens, head, k, args.repeats)
            ratios += r
            off_rates += off
            on_rates += on
            same &= ok
            accepted, drafted = accepted + d["accepted"], drafted + d["drafted"]
            rounds, emitted = rounds + d["rounds"], emitted + d["tokens_per_round"] * d["rounds"]
            by_pos = [b + a / len(prompts) for b, a in zip(by_pos, d["acceptance_by_position"])]
        print(f"{k:2d} {100 * accepted / max(drafted, 1):7.1f}% {' '.join(f'{100 * b:.0f}%' for b in by_pos):>18} "
              f"{emitted / max(rounds, 1):8.2f} {statistics.median(off_rates):9.1f} {statistics.median(on_rates):9.1f} "
              f"{statistics.median(ratios):7.2f}x  {'yes' if same else 'NO'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "strata" / "demo" / "strata-demo.gguf")
    p.add_argument("--tiny", action="store_true", help="the tiny random qwen3next with copying heads instead")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (held-out code) with --model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, nargs="*", default=[1, 2, 3, 4])
    p.add_argument("--alpha", type=float, nargs="*", default=[1.0, 0.8, 0.6])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not args.tiny:
        bench_model(args.model, args)
        return

    torch.manual_seed(0)
    model = tiny_qwen3next()
    work = Path(tempfile.mkdtemp(prefix="bench_draft_"))
    _, tensors = tiny_mtp(model, work / "aux")
    save_hf(model, work / "hf")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(work / "hf" / "mtp.safetensors"))
    engine = strata.load(work / "hf")
    mtp = engine.drafter

    prompts = [prompt(VOCAB, 32, seed=i) for i in range(args.prompts)]
    plain = {}
    for ids in prompts:
        run(engine, ids, 8)  # warm-up
        plain[tuple(ids)] = run(engine, ids, args.tokens)[0]

    heads = [("random", lambda ids, s: mtp)]
    heads += [(f"copied@{100 * a:.0f}%", lambda ids, s, a=a: Copied(mtp, ids + plain[tuple(ids)], a, s))
              for a in args.alpha]
    print(f"tiny qwen3next + MTP layer, fp32, {args.threads} thread(s), greedy, {args.tokens} new tokens, "
          f"{args.prompts} prompts x {args.repeats} runs, each paired with a --draft off run")
    print(f"{'head':12} {'k':>2} {'accepted':>8} {'tok/pass':>8} {'off tok/s':>9} {'on tok/s':>9} {'speedup':>8}"
          f"  same tokens")
    for name, make in heads:
        for k in args.k:
            ratios, off_rates, on_rates, same = [], [], [], True
            accepted = drafted = rounds = emitted = 0
            for pi, ids in enumerate(prompts):
                for r in range(args.repeats):
                    _, off, _ = run(engine, ids, args.tokens)
                    out, on, d = run(engine, ids, args.tokens, make(ids, pi), k)
                    same &= out == plain[tuple(ids)]
                    ratios.append(on / off)
                    off_rates.append(off)
                    on_rates.append(on)
                    if r == 0:
                        accepted, drafted = accepted + d["accepted"], drafted + d["drafted"]
                        rounds, emitted = rounds + d["rounds"], emitted + d["tokens_per_round"] * d["rounds"]
            print(f"{name:12} {k:2d} {100 * accepted / max(drafted, 1):7.1f}% {emitted / max(rounds, 1):8.2f} "
                  f"{statistics.median(off_rates):9.1f} {statistics.median(on_rates):9.1f} "
                  f"{statistics.median(ratios):7.2f}x  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
