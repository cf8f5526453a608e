"""The decode loop: one batch of sequences, advanced one `step` at a time (nano-vllm's
`LLMEngine.step` over its scheduler's running set).

`DecodeBatch.add` prefills new sequences (in chunks; prompts grouped into one right-padded batch
while the group's padded tokens fit one chunk) and samples each one's first token; their cache
rows join the running batch (`ModelCache.extend`). `step` advances every running row: with a
draft head, one speculative round per row (1..k+1 tokens, `strata.runtime.speculative`), the
rows drafting and verifying as one batch; without, one token per row. Each row samples with its
own parameters and generator, and its `StopText` (EOS, stop strings, its limit) turns tokens into
`Response`s; a row that ends leaves the batch at once (`ModelCache.select`).

`Engine.generate`, `Engine.stream` (so `strata run` and the benchmarks) and the server's
`Scheduler` all drive this one loop; `generate_step` is its bare token stream.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import Iterator

import torch

from strata import kernels
from strata.models.cache import ModelCache
from strata.runtime.sampling import SamplingParams
from strata.runtime.speculative import DraftStats, accept, draft
from strata.runtime.text import Response, StopText

__all__ = ["DecodeBatch", "Response", "Sequence", "generate_step", "prefill"]


def prefill(model, prompts: list[list[int]], cache: ModelCache, chunk: int = 8192, head=None,
            head_cache: ModelCache | None = None):
    """Run right-padded prompts through the model in chunks; return each row's last logits (B, V).

    With a draft `head` (and its `head_cache`), the head also reads the pairs (h_p, x_{p+1}) the
    prompts hold, and this returns (logits, pending): pending[b] (1, 1, hidden) is row b's hidden
    state at its last position, which the head reads once the next token is chosen.
    The products of a prompt take the prefill kernels from their fewest rows (`kernels.prompt_batches`)."""
    with kernels.prompt_batches():
        return _prefill(model, prompts, cache, chunk, head, head_cache)


def _prefill(model, prompts, cache, chunk, head, head_cache):
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = torch.tensor(p, dtype=torch.long)
    last, pending = None, [None] * len(prompts)
    for start in range(0, width, chunk):
        n_new = (lengths - start).clamp(0, chunk)
        end = min(start + chunk, width)
        if head is None:
            logits = model(tokens[:, start:end], cache, n_new=n_new, last_only=True)[:, 0]  # (B, V)
        else:
            logits, hidden = model(tokens[:, start:end], cache, n_new=n_new, last_only=True, hidden=True)
            logits = logits[:, 0]
            pairs = ((lengths - 1).clamp(max=end) - start).clamp(min=0)  # positions whose next token is known
            if int(pairs.max()) > 0:
                w = int(pairs.max())
                head(tokens[:, start + 1:start + 1 + w], hidden[:, :w], head_cache, n_new=pairs, last_only=True)
            for row, n in enumerate(n_new.tolist()):
                if n > 0:
                    pending[row] = hidden[row:row + 1, n - 1:n]
        last = logits if last is None else torch.where((n_new > 0)[:, None], logits, last)
    if head is not None and width == 1:  # no pair to read; one padded position (n_new 0, nothing
        # kept) so the head's caches hold these rows when they join a batch (`ModelCache.extend`)
        head(tokens, hidden, head_cache, n_new=torch.zeros(len(prompts), dtype=torch.long), last_only=True)
    return last if head is None else (last, pending)


class Sequence:
    """One request in the loop: its committed tokens, sampling, stop rules, and (drafting) the
    model's hidden states its draft head has not read yet."""

    def __init__(self, prompt: list[int], params: SamplingParams, text: StopText, owner=None):
        self.ids = list(prompt)  # the prompt, then every token made (the last not yet fed)
        self.n_prompt = len(prompt)
        self.params = params
        self.text = text
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.owner = owner  # the caller's handle (the scheduler's Request)
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.pending: torch.Tensor | None = None  # (1, P, hidden)

    @property
    def n_out(self) -> int:
        return len(self.ids) - self.n_prompt

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


Results = list[tuple[Sequence, list[Response]]]


class DecodeBatch:
    """The running batch: `add` sequences, `step` them all, `remove` any; see the module doc."""

    def __init__(self, model, drafter=None, draft_tokens: int = 2, prefill_chunk: int = 8192,
                 stats: DraftStats | None = None):
        self.model, self.drafter = model, drafter
        self.k = draft_tokens if drafter is not None else 0
        self.prefill_chunk = prefill_chunk
        self.stats = stats if stats is not None else (DraftStats(draft_tokens) if drafter is not None else None)
        self.rows: list[Sequence] = []
        self.cache: ModelCache | None = None
        self.head_cache: ModelCache | None = None

    @torch.inference_mode()
    def add(self, seqs: list[Sequence], cache: ModelCache | None = None) -> Results:
        """Prefill `seqs`, sample each one's first token; those not finished join the batch.
        `cache`: a fresh cache of len(seqs) rows to prefill into (one group), else new ones."""
        if cache is not None:
            return self._prefill(seqs, cache)
        results = []
        for group in _groups(seqs, self.prefill_chunk):
            results += self._prefill(group, self.model.new_cache(len(group)))
        return results

    def _prefill(self, group: list[Sequence], cache: ModelCache) -> Results:
        prompts = [s.ids for s in group]
        head_cache = None
        if self.drafter is None:
            logits = prefill(self.model, prompts, cache, self.prefill_chunk)
        else:
            head_cache = self.drafter.new_cache(len(group))
            logits, pending = prefill(self.model, prompts, cache, self.prefill_chunk, self.drafter, head_cache)
            for s, p in zip(group, pending):
                s.pending = p
        results = [(s, self._emit(s, self._accept(s, logits[i:i + 1], [], []))) for i, s in enumerate(group)]
        keep = [i for i, s in enumerate(group) if not s.finished]
        if keep:
            if len(keep) < len(group):
                cache.select(keep)
                if head_cache is not None:
                    head_cache.select(keep)
            self._join([group[i] for i in keep], cache, head_cache)
        return results

    def _join(self, seqs, cache, head_cache) -> None:
        if self.cache is None:
            self.cache, self.head_cache = cache, head_cache
            if self.drafter is not None:
                cache.track()  # verify passes keep what a rollback needs
        else:
            self.cache.extend(cache)
            if head_cache is not None:
                self.head_cache.extend(head_cache)
        self.rows += seqs

    @torch.inference_mode()
    def step(self) -> Results:
        """Advance every row by one decode step (a speculative round per row when drafting)."""
        rows, cache, stats = self.rows, self.cache, self.stats
        ks = [max(0, min(self.k, s.text.limit - s.n_out - 1)) for s in rows]  # never draft past a limit
        k = max(ks)
        t0 = time.perf_counter()
        drafts, qs = ([[] for _ in rows], [[] for _ in rows])
        if k > 0:
            drafts, qs = draft(self.drafter, self.head_cache, rows, ks, cache.lengths)
        t1 = time.perf_counter()
        if k == 0:  # each row's last token (one tensor op where the general form is 2 + 2 a row)
            tokens = torch.tensor([[s.ids[-1]] for s in rows])
        else:
            tokens = torch.zeros(len(rows), k + 1, dtype=torch.long)
            for i, s in enumerate(rows):
                tokens[i, :ks[i] + 1] = torch.tensor([s.ids[-1]] + drafts[i])
        if self.drafter is None:
            logits = self.model(tokens, cache, last_only=True)  # (B, 1, V)
        else:
            m = cache.lengths.clone()
            logits, hidden = self.model(tokens, cache, n_new=torch.tensor(ks) + 1, hidden=True)
        outs = [self._accept(s, logits[i, :ks[i] + 1], drafts[i], qs[i]) for i, s in enumerate(rows)]
        if self.drafter is not None:
            kept = [len(o) - 1 if o else 0 for o in outs]
            cache.rollback(torch.tensor([kr - j for kr, j in zip(ks, kept)]))
            if k > 0:  # the head read every row's pending pairs: keep those, drop its chained positions
                self.head_cache.rollback(self.head_cache.lengths - m)
            for i, s in enumerate(rows):
                new = hidden[i:i + 1, :kept[i] + 1]
                s.pending = new if k > 0 else torch.cat([s.pending, new], dim=1)
                stats.count(ks[i], kept[i], len(outs[i]))
            stats.passes += 1
            stats.draft_s += t1 - t0
            stats.verify_s += time.perf_counter() - t1
        results = [(s, self._emit(s, o)) for s, o in zip(rows, outs)]
        self.remove([s for s in rows if s.finished])
        return results

    def _accept(self, s: Sequence, logits, drafts, qs) -> list[int]:
        """The row's tokens this step (`speculative.accept`); a failure ends this row alone."""
        try:
            return accept(logits, drafts, qs, s.ids, s.params, s.generator)
        except Exception as e:
            s.error = e
            return []

    def _emit(self, s: Sequence, tokens: list[int]) -> list[Response]:
        """Commit `tokens` to `s` through its stop rules, up to the one that ends it."""
        out = []
        try:
            for t in tokens:
                s.ids.append(t)
                out.append(s.text.push(t))
                if out[-1].finish_reason is not None:
                    s.finish_reason = out[-1].finish_reason
                    break
        except Exception as e:
            s.error = e
        return out

    def remove(self, seqs: list[Sequence]) -> None:
        """Take `seqs` out of the batch (finished or cancelled); their cache rows go."""
        gone = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self.rows) if id(s) not in gone]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.head_cache = None
            return
        self.cache.select(keep)
        if self.head_cache is not None:
            self.head_cache.select(keep)

    def clear(self) -> list[Sequence]:
        """Drop every row (after a failed forward); returns them."""
        rows, self.rows, self.cache, self.head_cache = self.rows, [], None, None
        return rows


def _groups(seqs: list[Sequence], chunk: int) -> list[list[Sequence]]:
    """Consecutive prompts prefilled together while the group's padded tokens fit one chunk."""
    groups, width = [], 0
    for s in seqs:
        w = max(width, len(s.ids))
        if groups and (len(groups[-1]) + 1) * w <= chunk:
            groups[-1].append(s)
            width = w
        else:
            groups.append([s])
            width = len(s.ids)
    return groups


def generate_step(model, prompts: list[list[int]], params: SamplingParams, cache: ModelCache | None = None,
                  prefill_chunk: int = 8192, drafter=None, draft_tokens: int = 2, stats: DraftStats | None = None,
                  limit: int | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, a (B,) tensor at a time, up to `limit` (or forever):
    the decode loop with no stop rules (benchmarks, tests). `cache`: a fresh one to prefill into."""
    seqs = [Sequence(p, params, StopText(None, (), (), limit or sys.maxsize)) for p in prompts]
    batch = DecodeBatch(model, drafter, draft_tokens, prefill_chunk, stats)
    queues = {id(s): deque() for s in seqs}

    def take(results: Results) -> None:
        for s, responses in results:
            if s.error is not None:
                raise s.error
            queues[id(s)].extend(r.token for r in responses)

    take(batch.add(seqs, cache))
    while True:
        while all(queues.values()):
            yield torch.tensor([queues[id(s)].popleft() for s in seqs])
        if not batch.rows:
            return
        take(batch.step())
