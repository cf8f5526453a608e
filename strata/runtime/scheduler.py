"""Continuous batching: many requests share one decode batch.

One background thread owns the model and one batch `ModelCache`. A submitted request waits in a
bounded queue; when a slot frees it is prefilled alone (a B=1 cache, so its prompt never waits
for the others' padding), then its cache rows are appended to the running batch
(`ModelCache.extend`). Every decode step runs all active rows as one batch of one token each;
each row samples with its own parameters and seeded generator and applies its own stop rules
(EOS, stop strings with `stream_generate`'s hold-back, its length limit). A finished or
cancelled row leaves the batch at once (`ModelCache.select`).

With drafting on (the engine's `--draft`, a model with an MTP head), a request admitted while no
other runs drafts: each step is one speculative round (`speculative.DraftState`), 1..k+1 tokens,
greedy output unchanged. When another request joins, the drafting row stops drafting and both
decode as a batch.

torch is not async: callers talk to the thread through thread-safe queues. A `Request` is
iterated synchronously (`for r in request`) or asynchronously (`async for r in request`) and
yields `Response`s; `cancel()` frees its slot before the next decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from strata.errors import StrataError
from strata.runtime.generate import Response, _find_stop, _stop_safe_end, prefill
from strata.runtime.sampling import SamplingParams, sample
from strata.runtime.speculative import DraftState, DraftStats

log = logging.getLogger(__name__)

CANCELLED = "cancelled"  # finish_reason of a request its caller cancelled
THROUGHPUT_WINDOW_S = 10.0  # tokens/s is measured over this trailing window


class SchedulerError(StrataError):
    """A request the scheduler would not take (or could not finish)."""


class InvalidRequest(SchedulerError):
    """The request itself is wrong (empty prompt, token outside the vocabulary, bad limit)."""


class PromptTooLong(InvalidRequest):
    """The prompt does not fit the context."""


class QueueFull(SchedulerError):
    """Every slot is busy and the waiting queue is full; try again later."""


class SchedulerClosed(SchedulerError):
    """The scheduler is shutting down (or its engine thread has stopped)."""


class Request:
    """One submitted generation: iterate it for `Response`s, or `cancel()` it.

    The engine thread fills `token_ids`, `completion_tokens` and `finish_reason` as it goes;
    read them once the stream has ended. The last `Response` has a `finish_reason`: "stop",
    "length", or `CANCELLED`. An engine failure is raised from the iteration.
    """

    _ids = itertools.count(1)

    def __init__(self, prompt: list[int], max_tokens: int, params: SamplingParams, stop: list[str],
                 scheduler: "Scheduler"):
        self.id = next(self._ids)
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.params = params
        self.stop = stop
        self.prompt_tokens = len(prompt)
        self.completion_tokens = 0
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.ignore_eos = False  # fixed-length runs (benchmarks) generate past EOS
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._scheduler = scheduler
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._cancel = threading.Event()
        self.done = threading.Event()  # set once the final item is queued

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop generating; the slot is freed before the next decode step. Safe from any thread."""
        if not self.done.is_set() and not self._cancel.is_set():
            self._cancel.set()
            self._scheduler._wake()

    # -- the engine thread's side --------------------------------------------------------------

    def _deliver(self, item: Response | BaseException) -> None:
        with self._lock:
            self._items.put(item)
            loop, event = self._loop, self._event
        if loop is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop has closed
                pass

    # -- the consumer's side ---------------------------------------------------------------------

    def __iter__(self):
        while True:
            item = self._items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._loop is None:
                self._loop, self._event = loop, asyncio.Event()
            elif self._loop is not loop:
                raise RuntimeError("a request can be iterated from one event loop only")
        event = self._event
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                event.clear()
                if self._items.empty():  # nothing arrived between get and clear
                    await event.wait()
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    def text(self) -> str:
        """Block until the end; the whole completion text."""
        return "".join(r.text for r in self)


@dataclass(slots=True)
class _Row:
    """A request in the running batch (engine thread only)."""

    req: Request
    text: "StopText"
    generator: torch.Generator | None
    seen: list[int] = field(default_factory=list)  # context, kept only for repetition_penalty
    last: int = 0  # the token the next decode step feeds
    draft: DraftState | None = None  # drafting (it runs alone)
    committed: list[int] = field(default_factory=list)  # prompt and tokens, while drafting


class StopText:
    """Per-request text and stop rules, as `stream_generate` applies them.

    `push(token)` returns the `Response` for one sampled token: its text delta with any text that
    may begin a stop string held back, and a finish_reason once EOS, a stop string or `limit`
    tokens end the request. Unlike `stream_generate`, a request that ends (EOS or length)
    releases held-back text and the decoder's pending bytes.
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
        hit = _find_stop(self.text, self.stop, self.emitted)
        if hit is not None:
            return Response(token, self.text[self.emitted:hit], "stop")
        if self.n >= self.limit:
            return self._end(token, "length")
        safe = _stop_safe_end(self.text, self.stop)  # hold back what may begin a stop string
        delta, self.emitted = self.text[self.emitted:safe], safe
        return Response(token, delta, None)

    def _end(self, token: int | None, reason: str) -> Response:
        self.text += self._flush() if self._flush else ""
        hit = _find_stop(self.text, self.stop, self.emitted)
        if hit is not None:
            return Response(token, self.text[self.emitted:hit], "stop")
        return Response(token, self.text[self.emitted:], reason)


class Scheduler:
    """Continuous batching over one engine: `submit` requests, iterate their `Response`s.

    At most `max_concurrent` requests decode together; up to `max_waiting` more wait for a slot
    (default 4 x max_concurrent); past that `submit` raises `QueueFull`. After `close()` it
    raises `SchedulerClosed`.
    """

    def __init__(self, engine, max_concurrent: int = 8, max_waiting: int | None = None):
        if max_concurrent < 1:
            raise InvalidRequest("max_concurrent must be at least 1")
        self.engine = engine
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.eos_ids = set(engine.eos_ids)
        self.ctx_size = engine.ctx_size
        self.vocab_size = engine.config.vocab_size
        options = getattr(engine, "options", None)
        self.prefill_chunk = getattr(options, "prefill_chunk", 8192)
        self.drafter = engine.drafter if getattr(engine, "drafting", False) else None
        self.draft_stats = DraftStats(getattr(options, "draft_tokens", 2))
        self.max_concurrent = max_concurrent
        self.max_waiting = 4 * max_concurrent if max_waiting is None else max_waiting
        if self.max_waiting < 0:
            raise InvalidRequest("max_waiting must be >= 0")

        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._n_active = 0  # taken from the queue and not finished (prefilling or decoding)
        self._closing = False
        self._drain = False
        # counters; written by the engine thread (and submit, under the lock), read by anyone
        self.counters = {
            "requests_submitted": 0, "prompt_tokens": 0, "generated_tokens": 0, "decode_steps": 0,
            "prefill_seconds": 0.0, "decode_seconds": 0.0,
            # submit -> first token (queue wait and prefill included), over requests that got one
            "ttft_seconds_sum": 0.0, "ttft_count": 0,
            "request_seconds_sum": 0.0, "request_count": 0,  # submit -> end, every ended request
        }
        self.finished = {"stop": 0, "length": 0, CANCELLED: 0, "error": 0}
        self.rejected = {"queue_full": 0, "closed": 0, "invalid": 0}
        self._recent: deque[float] = deque()  # when each of the last window's tokens was sampled

        # engine thread only
        self._rows: list[_Row] = []
        self._cache = None
        self._num_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="strata-scheduler", daemon=True)
        self._thread.start()

    # -- public API (any thread) -----------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_tokens: int = 128, params: SamplingParams | None = None,
               stop: Sequence[str] = (), ignore_eos: bool = False) -> Request:
        """Queue one request; raises `InvalidRequest`, `PromptTooLong`, `QueueFull` or `SchedulerClosed`."""
        try:
            prompt = self._check(prompt, max_tokens, stop)
        except InvalidRequest:
            with self._cond:
                self.rejected["invalid"] += 1
            raise
        if isinstance(stop, str):
            stop = [stop]
        req = Request(prompt, int(max_tokens), params or SamplingParams(), list(stop), self)
        req.ignore_eos = ignore_eos
        with self._cond:
            if self._closing or not self._thread.is_alive():
                self.rejected["closed"] += 1
                raise SchedulerClosed("the server is shutting down", "retry against a running server")
            if self._n_active + len(self._waiting) >= self.max_concurrent + self.max_waiting:
                self.rejected["queue_full"] += 1
                raise QueueFull(f"all {self.max_concurrent} slots and {self.max_waiting} queue places are taken",
                                "retry later")
            self._waiting.append(req)
            self.counters["requests_submitted"] += 1
            self._cond.notify()
        return req

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 128,
                 params: SamplingParams | None = None, stop: Sequence[str] = ()) -> list[list[int]]:
        """Submit every prompt at once, block, return each one's token ids (EOS left out)."""
        reqs = [self.submit(p, max_tokens, params, stop) for p in prompts]
        for r in reqs:
            for _ in r:
                pass
        return [r.token_ids for r in reqs]

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Refuse new requests; `drain` lets queued and running ones finish, else they are
        failed with `SchedulerClosed`. Waits for the engine thread up to `timeout` seconds."""
        with self._cond:
            self._closing = True
            self._drain = drain
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def closing(self) -> bool:
        return self._closing or not self._thread.is_alive()

    def stats(self) -> dict:
        """A consistent snapshot for /metrics: counters, queue length, active requests, tokens/s."""
        now = time.perf_counter()
        cache = self._cache
        with self._cond:
            self._trim(now)
            span = max(now - self._recent[0], 1.0) if self._recent else 1.0
            tokens_per_s = len(self._recent) / span
            return {
                **self.counters,
                "finished": dict(self.finished),
                "rejected": dict(self.rejected),
                "active": self._n_active,
                "waiting": len(self._waiting),
                "max_concurrent": self.max_concurrent,
                "max_waiting": self.max_waiting,
                "tokens_per_s": tokens_per_s,
                "kv_cache_bytes": cache.nbytes if cache is not None else 0,
                "draft": self.draft_stats.as_dict() if self.drafter is not None else None,
                "closing": self.closing,
            }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- validation --------------------------------------------------------------------------------

    def _check(self, prompt, max_tokens, stop) -> list[int]:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be a non-negative integer, not {max_tokens!r}")
        if not isinstance(stop, str) and not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop strings must be strings")
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InvalidRequest("the prompt must be a list of token ids") from None
        if not ids:
            raise InvalidRequest("the prompt is empty", "pass at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if len(ids) > self.ctx_size:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens but the context holds {self.ctx_size}",
                                "shorten the prompt or raise --ctx-size")
        return ids

    # -- the engine thread -------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)  # thread-local under OpenMP: keep the caller's
        try:
            with torch.inference_mode():
                while self._step():
                    pass
        except BaseException as e:  # a bug in the loop itself: fail everything, refuse new work
            log.exception("scheduler thread stopped")
            self._fail_all(e)
            raise
        self._fail_all(SchedulerClosed("the server is shutting down", "retry against a running server"))

    def _step(self) -> bool:
        """One turn: take new requests, prefill them, run one decode step. False = stop."""
        with self._cond:
            while not self._closing and not self._waiting and not self._rows:
                self._cond.wait()
            if self._closing and (not self._drain or (not self._waiting and not self._rows)):
                return False
            admit = []
            while self._waiting and self._n_active < self.max_concurrent:
                admit.append(self._waiting.popleft())
                self._n_active += 1
            cancelled = [r for r in self._waiting if r.cancelled]
            for r in cancelled:
                self._waiting.remove(r)
                self._n_active += 1  # _finish counts it down
        for r in cancelled:
            self._finish(r, Response(None, "", CANCELLED))
        self._drop_cancelled()
        for req in admit:
            if req.cancelled:
                self._finish(req, Response(None, "", CANCELLED))
            else:
                with self._failing(req, "admitting a request"):
                    self._admit(req, alone=len(admit) == 1 and not self._rows and not self._waiting)
        if self._rows:
            self._decode()
        return True

    def _admit(self, req: Request, alone: bool = False) -> None:
        limit = min(req.max_tokens, self.ctx_size - len(req.prompt))
        if limit <= 0:
            self._finish(req, Response(None, "", "length"))
            return
        p = req.params
        row = _Row(req, StopText(self.tokenizer, req.stop, set() if req.ignore_eos else self.eos_ids, limit),
                   torch.Generator().manual_seed(p.seed) if p.seed is not None else None,
                   list(req.prompt) if p.repetition_penalty != 1.0 else [])
        t0 = time.perf_counter()
        try:
            cache = self.model.new_cache(1)
            if alone and self.drafter is not None:  # the head reads the prompt too
                row.draft = DraftState(self.model, self.drafter, p, row.generator, cache, self.draft_stats)
                logits = row.draft.prefill(list(req.prompt), self.prefill_chunk)[None]
                row.committed = list(req.prompt)
            else:
                logits = prefill(self.model, [req.prompt], cache, self.prefill_chunk)
        except Exception as e:
            log.exception("prefill failed")
            self._finish(req, e)
            return
        with self._cond:
            self.counters["prefill_seconds"] += time.perf_counter() - t0
            self.counters["prompt_tokens"] += len(req.prompt)
        req.first_token_at = time.perf_counter()
        if self._emit(row, logits):
            return
        if row.draft is not None:
            row.draft.start()
        for other in self._rows:  # a batch of several rows decodes without drafts
            self._stop_drafting(other)
        if self._cache is None:
            self._cache = cache
        else:
            self._cache.extend(cache)
        self._rows.append(row)

    def _stop_drafting(self, row: _Row) -> None:
        if row.draft is not None:
            row.draft.stop()
            row.draft, row.committed = None, []

    def _decode(self) -> None:
        if len(self._rows) == 1 and self._rows[0].draft is not None:
            return self._draft_round(self._rows[0])
        t0 = time.perf_counter()
        tokens = torch.tensor([[row.last] for row in self._rows], dtype=torch.long)
        try:
            logits = self.model(tokens, self._cache, last_only=True)[:, 0]  # (B, V)
        except Exception as e:
            log.exception("decode step failed")
            rows, self._rows, self._cache = self._rows, [], None
            for row in rows:
                self._finish(row.req, e)
            return
        keep = []
        for i, row in enumerate(self._rows):
            if row.req.cancelled:
                self._finish(row.req, Response(None, "", CANCELLED))
            else:
                with self._failing(row.req, "sampling a token"):
                    if not self._emit(row, logits[i:i + 1]):
                        keep.append(i)
        with self._cond:
            self.counters["decode_steps"] += 1
            self.counters["decode_seconds"] += time.perf_counter() - t0
        self._keep(keep)

    def _draft_round(self, row: _Row) -> None:
        """One speculative round for the only running row; its tokens are emitted one by one."""
        t0 = time.perf_counter()
        req = row.req
        k = min(row.draft.stats.draft_tokens, row.text.limit - row.text.n - 1)  # never past the limit
        try:
            out = row.draft.round(row.committed, max(k, 0))
        except Exception as e:
            log.exception("draft round failed")
            self._rows, self._cache = [], None
            self._finish(req, e)
            return
        ended = False
        for token in out:
            if req.cancelled:
                self._finish(req, Response(None, "", CANCELLED))
                ended = True
                break
            with self._failing(req, "emitting a drafted token"):
                ended = self._push(row, token)
            if ended or req.done.is_set():
                ended = True
                break
        with self._cond:
            self.counters["decode_steps"] += 1
            self.counters["decode_seconds"] += time.perf_counter() - t0
        if ended:
            self._keep([])

    def _emit(self, row: _Row, logits: torch.Tensor) -> bool:
        """Sample one token for `row` and hand its response over; True when the request ended."""
        p = row.req.params
        token = int(sample(logits, p, [row.seen] if p.repetition_penalty != 1.0 else [], row.generator)[0])
        return self._push(row, token)

    def _push(self, row: _Row, token: int) -> bool:
        """Hand `token`'s response over; True when the request ended."""
        p = row.req.params
        if p.repetition_penalty != 1.0:
            row.seen.append(token)
        if row.draft is not None:
            row.committed.append(token)
        row.last = token
        now = time.perf_counter()
        with self._cond:
            self.counters["generated_tokens"] += 1
            self._recent.append(now)
            self._trim(now)
        resp = row.text.push(token)
        req = row.req
        if resp.token is not None:
            req.token_ids.append(resp.token)
            req.completion_tokens += 1
        if resp.finish_reason is not None:
            self._finish(req, resp)
            return True
        req._deliver(resp)
        return False

    @contextlib.contextmanager
    def _failing(self, req: Request, what: str):
        """Per-request work: an exception ends this request with it; the others go on."""
        try:
            yield
        except Exception as e:
            log.exception("%s failed (request %d)", what, req.id)
            if not req.done.is_set():
                self._finish(req, e)

    def _drop_cancelled(self) -> None:
        keep = []
        for i, row in enumerate(self._rows):
            if row.req.cancelled:
                self._finish(row.req, Response(None, "", CANCELLED))
            else:
                keep.append(i)
        self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache = None
        else:
            self._cache.select(keep)

    def _finish(self, req: Request, last: Response | BaseException) -> None:
        """The request leaves: free its slot, then hand over its last item."""
        now = time.perf_counter()
        req.finished_at = now
        if isinstance(last, BaseException):
            req.error, reason = last, "error"
        else:
            req.finish_reason = reason = last.finish_reason
        with self._cond:
            self._n_active -= 1
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if req.first_token_at is not None:
                self.counters["ttft_seconds_sum"] += req.first_token_at - req.submitted_at
                self.counters["ttft_count"] += 1
            self.counters["request_seconds_sum"] += now - req.submitted_at
            self.counters["request_count"] += 1
            self._cond.notify_all()
        req.done.set()
        req._deliver(last)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), deque()
            self._n_active += len(waiting)
        rows, self._rows, self._cache = self._rows, [], None
        for req in [r.req for r in rows] + waiting:
            self._finish(req, error)

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()
