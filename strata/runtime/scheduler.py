"""Continuous batching: many requests share one decode loop (`strata.runtime.generate.DecodeBatch`).

One background thread owns the model and the loop. A submitted request waits in a bounded queue;
when slots free, the requests taken are prefilled (grouped into one right-padded batch while the
group's padded tokens fit one prefill chunk; a longer prompt goes alone) and their cache rows join
the running batch. Every decode step advances all active rows as one batch; each row samples
with its own parameters and seeded generator and applies its own stop rules (EOS, stop strings,
its length limit). A finished or cancelled row leaves the batch at once.

With drafting on (the engine's `--draft`, a model with an MTP head), every step is one
speculative round for every row (1..k+1 tokens each, greedy output unchanged): the head drafts
for all rows as one batch and one forward verifies them all.

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

import torch

from strata.errors import StrataError
from strata.runtime import generate
from strata.runtime.sampling import SamplingParams
from strata.runtime.speculative import DraftStats
from strata.runtime.text import Response, StopText

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
        draft_tokens = getattr(options, "draft_tokens", 2)
        self.draft_stats = DraftStats(draft_tokens)
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
        self._batch = generate.DecodeBatch(self.model, self.drafter, draft_tokens, self.prefill_chunk,
                                           self.draft_stats)
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
        cache = self._batch.cache
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
            while not self._closing and not self._waiting and not self._batch.rows:
                self._cond.wait()
            if self._closing and (not self._drain or (not self._waiting and not self._batch.rows)):
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
        seqs = []
        for req in admit:
            if req.cancelled:
                self._finish(req, Response(None, "", CANCELLED))
            else:
                with self._failing(req, "admitting a request"):
                    seq = self._sequence(req)
                    if seq is None:
                        self._finish(req, Response(None, "", "length"))
                    else:
                        seqs.append(seq)
        if seqs:
            self._admit(seqs)
        if self._batch.rows:
            self._decode()
        return True

    def _sequence(self, req: Request) -> generate.Sequence | None:
        """The loop's sequence for `req`, or None when the context leaves it no token to make."""
        limit = min(req.max_tokens, self.ctx_size - len(req.prompt))
        if limit <= 0:
            return None
        eos = set() if req.ignore_eos else self.eos_ids
        return generate.Sequence(req.prompt, req.params, StopText(self.tokenizer, req.stop, eos, limit), req)

    def _admit(self, seqs: list[generate.Sequence]) -> None:
        t0 = time.perf_counter()
        try:
            results = self._batch.add(seqs)
        except Exception as e:
            log.exception("prefill failed")
            self._batch.remove(seqs)
            for s in seqs:
                self._finish(s.owner, e)
            return
        now = time.perf_counter()
        with self._cond:
            self.counters["prefill_seconds"] += now - t0
            self.counters["prompt_tokens"] += sum(s.n_prompt for s in seqs)
        for s in seqs:
            s.owner.first_token_at = now
        self._hand_over(results)

    def _decode(self) -> None:
        t0 = time.perf_counter()
        try:
            results = self._batch.step()
        except Exception as e:
            log.exception("decode step failed")
            for s in self._batch.clear():
                self._finish(s.owner, e)
            return
        with self._cond:
            self.counters["decode_steps"] += 1
            self.counters["decode_seconds"] += time.perf_counter() - t0
        self._hand_over(results)

    def _hand_over(self, results) -> None:
        """Deliver each sequence's responses to its request; a request cancelled meanwhile ends."""
        cancelled = []
        for seq, responses in results:
            req = seq.owner
            if seq.error is not None:
                log.error("sampling failed (request %d): %r", req.id, seq.error)
                self._finish(req, seq.error)
                continue
            for resp in responses:
                if req.cancelled:
                    cancelled.append(seq)
                    self._finish(req, Response(None, "", CANCELLED))
                    break
                now = time.perf_counter()
                with self._cond:
                    self.counters["generated_tokens"] += 1
                    self._recent.append(now)
                    self._trim(now)
                if resp.token is not None:
                    req.token_ids.append(resp.token)
                    req.completion_tokens += 1
                if resp.finish_reason is not None:
                    self._finish(req, resp)
                else:
                    req._deliver(resp)
        self._batch.remove(cancelled)

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
        gone = [s for s in self._batch.rows if s.owner.cancelled]
        self._batch.remove(gone)
        for s in gone:
            self._finish(s.owner, Response(None, "", CANCELLED))

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
        rows = self._batch.clear()
        for req in [s.owner for s in rows] + waiting:
            self._finish(req, error)

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0] > THROUGHPUT_WINDOW_S:
            self._recent.popleft()
