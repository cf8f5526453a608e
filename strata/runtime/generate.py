"""Token generation in two layers: `generate_step` yields raw tokens for a batch of rows;
`stream_generate` adds stop rules and text for one request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from strata.models.cache import ModelCache
from strata.runtime.sampling import SamplingParams, sample


def prefill(model, prompts: list[list[int]], cache: ModelCache, chunk: int = 8192) -> torch.Tensor:
    """Run right-padded prompts through the model in chunks; return each row's last logits (B, V)."""
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = torch.tensor(p, dtype=torch.long)
    last = None
    for start in range(0, width, chunk):
        n_new = (lengths - start).clamp(0, chunk)
        end = min(start + chunk, width)
        logits = model(tokens[:, start:end], cache, n_new=n_new, last_only=True)[:, 0]  # (B, V)
        last = logits if last is None else torch.where((n_new > 0)[:, None], logits, last)
    return last


def generate_step(model, prompts: list[list[int]], params: SamplingParams, cache: ModelCache,
                  prefill_chunk: int = 8192) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, forever; the caller decides when to stop."""
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    seen = [list(p) for p in prompts]
    with torch.inference_mode():
        logits = prefill(model, prompts, cache, prefill_chunk)
        while True:
            tokens = sample(logits, params, seen if params.repetition_penalty != 1.0 else [], generator)
            for row, t in enumerate(tokens.tolist()):
                seen[row].append(t)
            yield tokens
            logits = model(tokens[:, None], cache, last_only=True)[:, 0]


@dataclass(slots=True)
class Response:
    token: int | None  # None on the final, stop-only response
    text: str  # new text since the previous response
    finish_reason: str | None = None  # "stop" or "length" on the last response


def stream_generate(model, tokenizer, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                    stop: list[str] = (), eos_ids: set[int] = frozenset(), max_length: int | None = None,
                    prefill_chunk: int = 8192, step_fn=None) -> Iterator[Response]:
    """One request: tokens with text deltas; stops on EOS, a stop string or a length limit.

    `step_fn` replaces `generate_step` (same arguments), e.g. the speculative loop's."""
    from strata.formats.tokenizer import IncrementalDecoder

    cache = model.new_cache(1)
    decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
    text, emitted = "", 0
    limit = max_new_tokens if max_length is None else min(max_new_tokens, max_length - len(prompt))
    if limit <= 0:
        yield Response(None, "", "length")
        return
    steps = (step_fn or generate_step)(model, [prompt], params, cache, prefill_chunk)
    for n, tokens in enumerate(steps, start=1):
        token = int(tokens[0])
        if token in eos_ids:
            yield Response(None, decoder.flush() if decoder else "", "stop")
            return
        delta = decoder.feed(token) if decoder else ""
        if decoder and n >= limit:
            delta += decoder.flush()
        text += delta
        hit = _find_stop(text, stop, emitted)
        if hit is not None:
            yield Response(token, text[emitted:hit], "stop")
            return
        # hold back text that may begin a stop string, unless this is the last token
        safe = len(text) if n >= limit else _stop_safe_end(text, stop)
        yield Response(token, text[emitted:safe], "length" if n >= limit else None)
        emitted = safe
        if n >= limit:
            return


def _find_stop(text: str, stop, emitted: int) -> int | None:
    hits = [text.find(s, max(0, emitted - len(s))) for s in stop if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


def _stop_safe_end(text: str, stop) -> int:
    end = len(text)
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end
