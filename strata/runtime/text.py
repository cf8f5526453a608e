"""One request's text and stop rules: token in, `Response` (text delta, finish_reason) out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Response:
    token: int | None  # None on a final, stop-only response (EOS, or an empty end)
    text: str  # new text since the previous response
    finish_reason: str | None = None  # "stop" or "length" on the last response


class StopText:
    """Per-request text and stop rules (EOS ids, stop strings, a limit of `limit` tokens).

    `push(token)` returns the `Response` for one sampled token: its text delta, with any text that
    may begin a stop string held back, and a finish_reason once EOS, a stop string or the limit
    ends the request. A request that ends on EOS or its length releases held-back text and the
    decoder's pending bytes. Without a tokenizer the text stays empty (token ids only).
    """

    def __init__(self, tokenizer, stop: Sequence[str], eos_ids, limit: int):
        self.stop = [s for s in stop if s]
        self.eos_ids = eos_ids
        self.limit = limit
        self.n = 0
        self.text, self.emitted = "", 0
        self._feed = self._flush = None
        if tokenizer is not None:
            from strata.formats.tokenizer import IncrementalDecoder

            decoder = IncrementalDecoder(tokenizer)
            self._feed, self._flush = decoder.feed, decoder.flush

    def push(self, token: int) -> Response:
        self.n += 1
        if token in self.eos_ids:
            return self._end(None, "stop")
        self.text += self._feed(token) if self._feed else ""
        hit = find_stop(self.text, self.stop, self.emitted)
        if hit is not None:
            return Response(token, self.text[self.emitted:hit], "stop")
        if self.n >= self.limit:
            return self._end(token, "length")
        safe = stop_safe_end(self.text, self.stop)  # hold back what may begin a stop string
        delta, self.emitted = self.text[self.emitted:safe], safe
        return Response(token, delta, None)

    def _end(self, token: int | None, reason: str) -> Response:
        self.text += self._flush() if self._flush else ""
        hit = find_stop(self.text, self.stop, self.emitted)
        if hit is not None:
            return Response(token, self.text[self.emitted:hit], "stop")
        return Response(token, self.text[self.emitted:], reason)


def find_stop(text: str, stop, emitted: int) -> int | None:
    """Where the first stop string starts in `text`, looking only where new text can complete one."""
    hits = [text.find(s, max(0, emitted - len(s))) for s in stop if s]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


def stop_safe_end(text: str, stop) -> int:
    """How much of `text` may be shown: up to any tail that may begin a stop string."""
    end = len(text)
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end
