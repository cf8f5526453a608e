"""Speculative decoding with the model's own multi-token-prediction (MTP) draft head.

One round, with m tokens in the model's cache and x_m the last committed token (not yet fed):

1. draft: the head catches up on the committed pairs (h_p, x_{p+1}) it has not seen (the model's
   hidden states from the last verify pass, or from the prompt), which yields d_1; then it
   chains on its own output for d_2..d_k (`--draft-tokens` k).
2. verify: the model runs [x_m, d_1..d_k] (k+1 positions) in one forward, with its recurrent
   layers tracking (`ModelCache.track`), and returns logits and hidden states for each.
3. accept the longest prefix of drafts the model agrees with, plus one token of the model's
   own at the first disagreement (or after the last draft: the bonus token), so a round
   yields 1..k+1 tokens.
4. roll back: `cache.rollback(k - j)` shortens the attention caches (row lengths) and
   restores each Gated DeltaNet state and conv window to the one after the last kept position
   (exactly: the verify pass runs the token-by-token recurrence, which a rollback replays over
   the kept tokens only); the head's own KV cache drops its chained positions too, keeping the
   pairs it read from the model (the next round feeds it the model's hidden states there).

Acceptance. Greedy: a draft is kept while it equals the model's argmax (after the repetition
penalty), so the output is the model's own greedy output token for token, whatever the head
drafts. Sampling: standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): d_i
is sampled from the head's distribution q (after the same temperature, top-k, top-p, min-p and
repetition penalty as the model's p), kept with probability min(1, p(d_i) / q(d_i)); at the
first rejection the token is drawn from max(0, p - q) renormalised; after k acceptances the
bonus token from p. Every token is then distributed exactly as plain sampling draws it, though
the random stream differs, so a seed does not give the same text as `--draft off`.

Batch size 1: the server's scheduler drafts while one request runs (`DraftState`); rows of a
batch decode without drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from strata.models.cache import ModelCache
from strata.runtime.sampling import (SamplingParams, apply_repetition_penalty, filter_min_p, filter_top_k,
                                     filter_top_p)


@dataclass(slots=True)
class DraftStats:
    """Acceptance bookkeeping of one speculative run."""

    draft_tokens: int  # k
    rounds: int = 0  # verify passes
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of which the model kept
    emitted: int = 0  # tokens the rounds produced (accepted + one of the model's own each)
    accepted_at: list[int] = field(default_factory=list)  # per draft position i: rounds that kept d_i
    drafted_at: list[int] = field(default_factory=list)  # per draft position i: rounds that drafted d_i
    draft_s: float = 0.0  # time in the head
    verify_s: float = 0.0  # time in the model's verify passes (and rollbacks)

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.draft_tokens
        self.drafted_at = self.drafted_at or [0] * self.draft_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "rounds": self.rounds, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "tokens_per_round": self.emitted / self.rounds if self.rounds else 0.0,
                "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
                "draft_s": self.draft_s, "verify_s": self.verify_s}


def probs(logits: torch.Tensor, params: SamplingParams, seen: list[int]) -> torch.Tensor:
    """The distribution `sample` draws from, for one row of logits (V,) -> (V,)."""
    x = apply_repetition_penalty(logits.float()[None], [seen], params.repetition_penalty)
    x = x / params.temperature
    x = filter_min_p(filter_top_p(filter_top_k(x, params.top_k), params.top_p), params.min_p)
    return torch.softmax(x, dim=-1)[0]


def greedy(logits: torch.Tensor, params: SamplingParams, seen: list[int]) -> int:
    """`sample`'s greedy choice for one row (V,), repetition penalty included."""
    return int(apply_repetition_penalty(logits.float()[None], [seen], params.repetition_penalty).argmax())


class DraftState:
    """One sequence's speculative decoding: its model cache (tracking while rounds run), the head's
    own cache and the hidden states the head has not read yet. `prefill` then `round`s; the
    engine's `speculative_steps` and the server's scheduler both run these."""

    def __init__(self, model, drafter, params: SamplingParams, generator: torch.Generator | None,
                 cache: ModelCache, stats: DraftStats):
        if cache.batch != 1:
            raise ValueError("speculative decoding runs one sequence at a time")
        self.model, self.drafter, self.params, self.generator = model, drafter, params, generator
        self.cache, self.dcache, self.stats = cache, drafter.new_cache(1), stats
        self.pending = None

    def prefill(self, prompt: list[int], chunk: int) -> torch.Tensor:
        """The model and the head over the prompt; the last logits (V,). Tracking starts after."""
        logits, self.pending = _prefill(self.model, self.drafter, prompt, self.cache, self.dcache, chunk)
        return logits

    def start(self) -> None:
        """From now on the cache keeps what a rejected draft's rollback needs."""
        self.cache.track()

    def round(self, seen: list[int], k: int) -> list[int]:
        """Draft k tokens after `seen` (every committed token; the last not yet fed), verify them in
        one forward, keep the agreed prefix plus one of the model's own: 1..k+1 tokens."""
        stats, cache, dcache = self.stats, self.cache, self.dcache
        t0 = time.perf_counter()
        drafts, qs, self.pending = _draft(self.drafter, dcache, cache, seen, self.pending, k, self.params,
                                          self.generator)
        t1 = time.perf_counter()
        m = int(cache.lengths[0])
        logits, hidden = self.model(torch.tensor([[seen[-1]] + drafts]), cache, hidden=True)
        out = _accept(logits[0], drafts, qs, seen, self.params, self.generator)
        j = len(out) - 1  # drafts kept
        cache.rollback(k - j)
        dcache.rollback(max(0, int(dcache.lengths[0]) - m))  # keep the pairs read from the model
        self.pending = torch.cat([self.pending, hidden[:, :j + 1]], dim=1)
        stats.verify_s += time.perf_counter() - t1
        stats.draft_s += t1 - t0
        _count(stats, k, j, len(out))
        return out

    def stop(self) -> None:
        self.cache.track(False)


def speculative_steps(model, drafter, prompt: list[int], params: SamplingParams, cache: ModelCache | None = None,
                      draft_tokens: int = 2, limit: int | None = None, prefill_chunk: int = 8192,
                      stats: DraftStats | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token (a (1,) tensor, as `generate_step` does), one at a time.

    `drafter(tokens, hidden, cache, last_only=...) -> (logits, g)` with `drafter.new_cache(1)`
    is the model's `MTPHead` (or a test double). `limit` caps the tokens this will ever be
    asked for, so no round drafts past it; the caller stops pulling at EOS or its limit.
    """
    if draft_tokens < 1:
        raise ValueError("draft_tokens must be >= 1")
    stats = stats if stats is not None else DraftStats(draft_tokens)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    state = DraftState(model, drafter, params, generator, cache if cache is not None else model.new_cache(1), stats)
    seen = list(prompt)  # committed tokens: the prompt and every token yielded
    emitted = 0
    with torch.inference_mode():
        logits = state.prefill(prompt, prefill_chunk)
        first = greedy(logits, params, seen) if params.greedy else _draw(probs(logits, params, seen), generator)
        seen.append(first)
        emitted += 1
        yield torch.tensor([first])
        state.start()
        try:
            while limit is None or emitted < limit:
                k = draft_tokens if limit is None else min(draft_tokens, limit - emitted - 1)
                for t in state.round(seen, k):
                    seen.append(t)
                    emitted += 1
                    yield torch.tensor([t])
        finally:
            state.stop()


def _prefill(model, drafter, prompt, cache, dcache, chunk):
    """The model over the prompt in chunks (last logits, every hidden state); the head reads the
    pairs (h_p, x_{p+1}) the prompt already holds. Returns the last logits (V,) and the hidden
    state the head has not read yet (position n-1: its next token is not chosen yet)."""
    tokens = torch.tensor([prompt], dtype=torch.long)
    n = len(prompt)
    logits = pending = None
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        logits, hidden = model(tokens[:, start:end], cache, last_only=True, hidden=True)
        pairs = min(end, n - 1) - start  # positions whose next token is the prompt's
        if pairs > 0:
            drafter(tokens[:, start + 1:start + 1 + pairs], hidden[:, :pairs], dcache, last_only=True)
        pending = hidden[:, pairs:]
    return logits[0, -1], pending


def _draft(drafter, dcache, cache, seen, pending, k, params, generator):
    """k draft tokens (and, when sampling, the distributions they were drawn from)."""
    if k <= 0:
        return [], [], pending
    m = int(cache.lengths[0])
    first = int(dcache.lengths[0]) + 1
    catch_up = torch.tensor([seen[first:m + 1]], dtype=torch.long)  # x_{p+1} for the pending h_p
    logits, g = drafter(catch_up, pending, dcache, last_only=True)
    drafts, qs = [], []
    for i in range(k):
        context = seen + drafts
        if params.greedy:
            drafts.append(greedy(logits[0, -1], params, context))
        else:
            q = probs(logits[0, -1], params, context)
            qs.append(q)
            drafts.append(_draw(q, generator))
        if i + 1 < k:
            logits, g = drafter(torch.tensor([[drafts[-1]]]), g[:, -1:], dcache)
    return drafts, qs, pending[:, :0]


def _accept(logits, drafts, qs, seen, params, generator) -> list[int]:
    """The round's tokens: the drafts the model keeps, then one of its own. logits (k+1, V)."""
    out = []
    for i, d in enumerate(drafts):
        context = seen + drafts[:i]
        if params.greedy:
            t = greedy(logits[i], params, context)
            if t != d:
                return out + [t]
        else:
            p, q = probs(logits[i], params, context), qs[i]
            if float(torch.rand(1, generator=generator)) >= float(p[d] / q[d]):
                residual = (p - q).clamp(min=0)
                return out + [_draw(residual if float(residual.sum()) > 0 else p, generator)]
        out.append(d)
    context = seen + drafts
    last = logits[len(drafts)]
    return out + [greedy(last, params, context) if params.greedy else _draw(probs(last, params, context), generator)]


def _draw(p: torch.Tensor, generator) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=generator))


def _count(stats: DraftStats, k: int, j: int, n_out: int) -> None:
    stats.rounds += 1
    stats.drafted += k
    stats.accepted += j
    stats.emitted += n_out
    for i in range(k):
        stats.drafted_at[i] += 1
        stats.accepted_at[i] += i < j
