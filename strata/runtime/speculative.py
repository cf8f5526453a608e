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

Batches: every row of the decode batch drafts (`strata.runtime.generate.DecodeBatch.step`): the
head's catch-up and chained steps run as one batch, the verify pass is one forward of k_r+1
right-padded positions per row (k_r: the row's own drafts, fewer near its limit), and each row
keeps its own prefix (`ModelCache.rollback` takes a count per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from strata.models.cache import ModelCache
from strata.runtime.sampling import SamplingParams, probs, sample


@dataclass(slots=True)
class DraftStats:
    """Acceptance bookkeeping of one speculative run (one engine call, or a server's lifetime)."""

    draft_tokens: int  # k
    rounds: int = 0  # row rounds: one row's drafts judged by one verify pass
    passes: int = 0  # verify passes (one per decode step; a batch's rows share it)
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
        return {"draft_tokens": self.draft_tokens, "rounds": self.rounds, "passes": self.passes,
                "drafted": self.drafted, "accepted": self.accepted, "acceptance_rate": self.acceptance_rate,
                "tokens_per_round": self.emitted / self.rounds if self.rounds else 0.0,
                "acceptance_by_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
                "draft_s": self.draft_s, "verify_s": self.verify_s}

    def count(self, k: int, j: int, n_out: int) -> None:
        """One row's round: k drafted, j kept, n_out tokens out."""
        self.rounds += 1
        self.drafted += k
        self.accepted += j
        self.emitted += n_out
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < j


def draft(drafter, head_cache: ModelCache, rows, ks: list[int], lengths: torch.Tensor):
    """Every row's drafts, the head running the rows as one batch: (drafts, qs) per row.

    `rows` carry `ids` (every committed token; the last not yet fed), `pending` (1, P, hidden),
    the model's hidden states the head has not read, `params` and `generator`; `lengths` are
    the model cache's row lengths m. The head first reads each row's pending pairs
    (h_p, x_{p+1}) for p = m-P..m-1, which yields d_1; then it chains on its own output for
    d_2..d_k. qs are the distributions sampled drafts were drawn from (empty when greedy)."""
    b, width = len(rows), max(r.pending.shape[1] for r in rows)
    tokens = torch.zeros(b, width, dtype=torch.long)
    hidden = rows[0].pending.new_zeros(b, width, rows[0].pending.shape[2])
    for i, r in enumerate(rows):
        p, m = r.pending.shape[1], int(lengths[i])
        tokens[i, :p] = torch.tensor(r.ids[m + 1 - p:m + 1])
        hidden[i, :p] = r.pending[0]
    n_new = torch.tensor([r.pending.shape[1] for r in rows])
    logits, g = drafter(tokens, hidden, head_cache, n_new=n_new, last_only=True)
    drafts, qs = [[] for _ in rows], [[] for _ in rows]
    for i in range(max(ks)):
        if i:
            last = torch.tensor([[d[-1] if d else 0] for d in drafts])
            logits, g = drafter(last, g[:, -1:], head_cache)
        for row, r in enumerate(rows):
            if i < ks[row]:
                context = [r.ids + drafts[row]]
                if r.params.greedy:
                    drafts[row].append(int(sample(logits[row, -1:], r.params, context)[0]))
                else:
                    q = probs(logits[row, -1:], r.params, context)[0]
                    qs[row].append(q)
                    drafts[row].append(_draw(q, r.generator))
    return drafts, qs


def accept(logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor], seen: list[int],
           params: SamplingParams, generator) -> list[int]:
    """The round's tokens: the drafts the model keeps, then one of its own. logits (k+1, V).

    With no drafts this is plain sampling of one token (`sample`)."""
    out = []
    for i, d in enumerate(drafts):
        context = [seen + drafts[:i]]
        if params.greedy:
            t = int(sample(logits[i:i + 1], params, context)[0])
            if t != d:
                return out + [t]
        else:
            p, q = probs(logits[i:i + 1], params, context)[0], qs[i]
            if float(torch.rand(1, generator=generator)) >= float(p[d] / q[d]):
                residual = (p - q).clamp(min=0)
                return out + [_draw(residual if float(residual.sum()) > 0 else p, generator)]
        out.append(d)
    k = len(drafts)
    return out + [int(sample(logits[k:k + 1], params, [seen + drafts], generator)[0])]


def _draw(p: torch.Tensor, generator) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=generator))

