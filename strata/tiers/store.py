"""Experts' homes: RAM (loaded once, page-locked with CUDA) or disk (read on demand).

Both read the GGUF with explicit `pread`s (O_DIRECT where the filesystem allows it, else
followed by `posix_fadvise(DONTNEED)`), so the OS page cache is never the cache: decode
speed does not swing with memory pressure, and RAM use is what the plan says.
An expert is three byte ranges (gate, up, down), each `[out, in]` in its stored type.
"""

from __future__ import annotations

import mmap
import os
import queue
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from strata.errors import StrataError
from strata.formats.weights import QTensor
from strata.tiers.arena import Arena

ALIGN = 4096
CHUNK = 64 * 2**20
DIRECT_MIN = 64 * 2**10  # an expert this large is read straight into its own aligned buffer; smaller ones are copied


def read_slack(bytes_per_expert: int) -> int:
    """Most bytes a cached expert's buffer holds beyond its own: each of its three direct reads'
    aligned cover (2 pages more at most), and one page to align the buffer. Small experts are
    read exactly."""
    return (3 * 2 + 1) * ALIGN if bytes_per_expert >= DIRECT_MIN else 0


READERS = 8  # disk reads in flight at once: an NVMe/virtio disk needs several to reach its bandwidth
SPARES = READERS  # evicted experts' buffers a disk home keeps for its next reads


@dataclass(frozen=True, slots=True)
class Part:
    """One projection of one layer's experts: per-expert type, shape and size, and file offset."""

    qtype: object
    shape: tuple[int, ...]  # one expert, [out, in]
    nbytes: int  # one expert
    offset: int | None  # file offset of expert 0, when the source is a GGUF


@dataclass(frozen=True, slots=True)
class ExpertFormat:
    """How one layer lays out an expert: gate | up | down bytes, back to back in a slot."""

    parts: tuple[Part, Part, Part]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A flat uint8 buffer (a slot, a read) -> the three projections' byte views."""
        out, start = [], 0
        for p in self.parts:
            out.append(flat[start:start + p.nbytes])
            start += p.nbytes
        return tuple(out)

    def qtensors(self, parts) -> tuple[QTensor, ...]:
        """(gate, up, down) in their stored type, viewing the given bytes (a slot, a home, a read)."""
        return tuple(QTensor(raw.reshape(p.shape[0], -1), p.qtype, p.shape) for raw, p in zip(parts, self.parts))

    def weights(self, parts, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Dequantized (gate, up, down) exactly as the resident path does: same bytes, same code."""
        return tuple(q.dequantize(dtype) for q in self.qtensors(parts))


def expert_format(qtensors, offsets=None) -> ExpertFormat:
    """From a layer's stacked (gate, up, down) QTensors; offsets of each in the file, if any."""
    offsets = offsets or (None, None, None)
    return ExpertFormat(tuple(Part(q.qtype, q.shape[1:], q.nbytes // q.shape[0], off)
                              for q, off in zip(qtensors, offsets)))


class FileReader:
    """Positional reads that leave no trace in the page cache; counts what it reads, and the time
    at least one read was in flight (`busy_s`), so `device_bytes / busy_s` is the bandwidth these
    reads got from the disk: a run's own figure, measured while it waited, beside any probe."""

    def __init__(self, path):
        self.path = str(path)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError:  # tmpfs and some network filesystems refuse O_DIRECT
            self.direct = False
            self.fd = os.open(self.path, os.O_RDONLY)
        self.bytes_read = 0  # bytes asked for
        self.device_bytes = 0  # bytes actually transferred (alignment included)
        self.reads = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clock = time.perf_counter
        self._active = 0  # reads in flight now
        self._busy_since = 0.0
        self._busy_s = 0.0  # closed intervals with at least one read in flight

    @property
    def busy_s(self) -> float:
        """Seconds during which at least one of this reader's reads was in flight (so far)."""
        with self._lock:
            return self._busy_s + (self._clock() - self._busy_since if self._active else 0.0)

    def _begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = self._clock()
            self._active += 1

    def _end(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._busy_s += self._clock() - self._busy_since

    def read_into(self, out: torch.Tensor, offset: int) -> None:
        """Fill the contiguous uint8 tensor `out` with the file's bytes from `offset`.

        A failed read (the file truncated or deleted, the disk gone) is a StrataError naming the
        file, so a run or a request ends with one line instead of a traceback from a reader thread."""
        done = 0
        while done < out.numel():
            n = min(CHUNK, out.numel() - done)
            self._begin()
            try:
                moved = self._read_chunk(out[done:done + n], offset + done)
            except OSError as e:
                raise StrataError(f"reading {self.path} at byte {offset + done} failed: {e.strerror or e}",
                                  "the model file must stay readable while Strata runs: check the disk, "
                                  "or hold the experts in RAM with --pin-experts ram") from None
            finally:
                self._end()
            done += n
            with self._lock:
                self.bytes_read += n
                self.device_bytes += moved
                self.reads += 1

    def _layout(self, spans) -> tuple[list[tuple[int, int, int, int]] | None, int]:
        """(each span's aligned cover (start, length, offset, n) for O_DIRECT, or None where the
        spans are read exactly (no O_DIRECT, or a small total); the buffer bytes that needs)."""
        total = sum(n for _, n in spans)
        if not self.direct or total < DIRECT_MIN:
            return None, total
        covers = [(o - o % ALIGN, -(-(o + n - (o - o % ALIGN)) // ALIGN) * ALIGN, o, n) for o, n in spans]
        return covers, sum(c[1] for c in covers) + ALIGN

    def direct_bytes(self, spans) -> int:
        """The buffer `read_spans(spans)` reads into: each span's aligned cover and one page to
        align it with O_DIRECT, else the spans' bytes exactly."""
        return self._layout([(int(o), int(n)) for o, n in spans])[1]

    def read_spans(self, spans, into: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The file's bytes at each (offset, n) of `spans`, as views of one buffer of their own,
        read straight into it: with O_DIRECT each span's aligned cover has its own aligned place
        in the buffer, so nothing is copied through a staging buffer. The buffer is `into` (a
        uint8 tensor of at least `direct_bytes(spans)`, which the caller reuses) or a new one per call.
        Small totals take an exact buffer and the staging copy. Errors as `read_into`."""
        spans = [(int(o), int(n)) for o, n in spans]
        covers, need = self._layout(spans)  # once: the size check and the reads share it
        if into is not None and into.numel() < need:
            raise ValueError(f"read_spans needs a buffer of {need} bytes, got {into.numel()}")
        if covers is None:
            buf = torch.empty(need, dtype=torch.uint8) if into is None else into[:need]
            out, at = [], 0
            for offset, n in spans:
                out.append(buf[at:at + n])
                self.read_into(out[-1], offset)
                at += n
            return tuple(out)
        buf = torch.empty(need, dtype=torch.uint8) if into is None else into
        at = (-buf.data_ptr()) % ALIGN
        whole = memoryview(buf.numpy())
        out = []
        self._begin()
        try:
            for start, length, offset, n in covers:
                self._direct_into(whole[at:at + length], start, offset - start + n)
                out.append(buf[at + offset - start:at + offset - start + n])
                with self._lock:
                    self.bytes_read += n
                    self.device_bytes += length
                    self.reads += 1
                at += length
        finally:
            self._end()
        return tuple(out)

    def _direct_into(self, view: memoryview, start: int, need: int) -> None:
        done = 0
        try:
            while done < need:
                got = os.preadv(self.fd, [view[done:]], start + done)
                if got <= 0:
                    raise OSError(f"{self.path}: short read at byte {start + done}")
                done += got
        except OSError as e:
            raise StrataError(f"reading {self.path} at byte {start + done} failed: {e.strerror or e}",
                              "the model file must stay readable while Strata runs: check the disk, "
                              "or hold the experts in RAM with --pin-experts ram") from None

    def _read_chunk(self, out: torch.Tensor, offset: int) -> int:
        if not self.direct:
            _pread_exact(self.fd, memoryview(out.numpy()), offset)
            os.posix_fadvise(self.fd, offset, out.numel(), os.POSIX_FADV_DONTNEED)
            return out.numel()
        start = offset - offset % ALIGN
        length = -(-(offset + out.numel() - start) // ALIGN) * ALIGN
        buf = self._buffer(length)
        got = os.preadv(self.fd, [memoryview(buf)[:length]], start)
        if got < offset - start + out.numel():
            raise OSError(f"{self.path}: short read at byte {offset}")
        out.copy_(torch.frombuffer(buf, dtype=torch.uint8, count=out.numel(), offset=offset - start))
        return got

    def _buffer(self, length: int) -> mmap.mmap:
        """A page-aligned buffer per thread (anonymous mmap), grown on demand."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < length:
            buf = mmap.mmap(-1, max(length, 2**20))
            self._local.buf = buf
        return buf

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _pread_exact(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += got


class Home:
    """Where a layer's experts live: `parts(layer, e)` gives expert e's (gate, up, down) bytes."""

    kind = "ram"

    def parts(self, layer: int, e: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def request(self, layer: int, experts, ahead: bool = False) -> None:
        """Start reading these experts (a home in memory has them already: nothing to do)."""

    def close(self) -> None:
        """Stop any reader threads (none for a home in memory)."""


class RamHome(Home):
    """Every expert in anonymous (page-locked with CUDA) memory, read once at start."""

    kind = "ram"

    def __init__(self, formats: dict[int, ExpertFormat], n_experts: dict[int, int], reader=None,
                 sources=None, pin: bool = False, advance=None):
        """`advance(n_bytes)` is called after each projection is read (a progress bar's)."""
        self.formats = formats
        self.data: dict[int, tuple[torch.Tensor, ...]] = {}
        for layer, fmt in formats.items():
            parts = []
            for i, p in enumerate(fmt.parts):
                parts.append(self._load(p, n_experts[layer], reader, (sources or {}).get(layer, ()), i, pin))
                if advance is not None:
                    advance(parts[-1].numel())
            self.data[layer] = tuple(parts)
        self.bytes_read = 0

    @staticmethod
    def _load(part: Part, n: int, reader, stacked, i: int, pin: bool) -> torch.Tensor:
        out = torch.empty((n, part.nbytes), dtype=torch.uint8, pin_memory=pin)  # (E, bytes per expert)
        if reader is not None and part.offset is not None:
            reader.read_into(out.view(-1), part.offset)
        else:  # a source without file offsets (safetensors): copy the already-mapped bytes
            out.copy_(stacked[i].raw.reshape(n, -1))
        return out

    def to_device(self, device: torch.device) -> None:
        """Experts pinned on the device by an override: always hits, never evicted."""
        self.data = {i: tuple(t.to(device) for t in ts) for i, ts in self.data.items()}
        self.kind = "gpu"

    def parts(self, layer: int, e: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[e] for t in self.data[layer])

    def stats(self) -> dict:
        return {"home": self.kind, "bytes": sum(t.numel() for ts in self.data.values() for t in ts)}


def _arena(capacity: int) -> Arena | None:
    """The RAM cache's arena, or None where the kernel refuses one mapping that large (the cache then
    allocates a buffer per read, as a small cache does)."""
    try:
        return Arena(capacity)
    except (OSError, ValueError, OverflowError):
        return None


def _held(parts: tuple[torch.Tensor, ...]) -> int:
    """Bytes a read expert holds: its buffer (each storage once), alignment slack included."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in parts}.values())


class ReadQueue:
    """`threads` reader threads that run `fetch(key)` for each submitted key, a layer's demanded
    reads before any read started ahead from a prediction (FIFO within each): a prediction's reads
    for the next layer are queued before this layer routes, and its misses must not wait behind
    them. A queued read ahead that a layer then asks for moves to the front (`promote`)."""

    def __init__(self, fetch, threads: int):
        self._fetch = fetch
        self._cond = threading.Condition()
        self._urgent: deque = deque()
        self._later: OrderedDict = OrderedDict()  # key -> future, not started yet
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"strata-read-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, key, urgent: bool) -> Future:
        future: Future = Future()
        with self._cond:
            if urgent:
                self._urgent.append((key, future))
            else:
                self._later[key] = future
            self._cond.notify()
        return future

    def cancel(self, key) -> bool:
        """Drop a queued read ahead that has not started (its future is cancelled); False if it has."""
        with self._cond:
            future = self._later.pop(key, None)
        if future is None:
            return False
        future.cancel()
        return True

    def promote(self, key) -> None:
        with self._cond:
            future = self._later.pop(key, None)
            if future is not None:
                self._urgent.append((key, future))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._later or self._closed):
                    self._cond.wait()
                if self._urgent:
                    key, future = self._urgent.popleft()
                elif self._later:
                    key, future = self._later.popitem(last=False)
                else:
                    return
            try:
                future.set_result(self._fetch(key))
            except BaseException as e:  # noqa: BLE001 - the reader's error goes to whoever waits
                future.set_exception(e)

    def shutdown(self) -> None:
        """Finish the queued reads, then stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()


class DiskHome(Home):
    """Experts read from the file on demand into a RAM cache of `capacity` bytes (LRU).

    Reads run on a pool of `readers` threads, so a layer's missing experts (and the next layer's
    predicted ones, `request(..., ahead=True)`) are read several at a time while the CPU computes
    on those already here. Each read lands in fresh buffers (read straight into them, no bounce
    copy), so a CPU worker still computing from an evicted entry keeps its bytes alive; the
    cache only drops its own reference. An evicted expert's buffer is kept (`SPARES` at most,
    within `capacity`) and read into again once nothing else holds a view of it: a fresh buffer
    per read cost more CPU than the read itself (the kernel maps and zeroes every page of it,
    0.3-0.9 ms an expert on this kind of machine, against 0.1-0.15 ms for the read). A cache of
    at least 4 x `SPARES` experts takes its buffers from one `Arena` of `capacity` bytes, populated
    in the background from load on, so filling the cache faults no page per read; every evicted
    buffer is kept there.
    Counted: hits, misses, reads started ahead, reads in flight (most at once), time waited.
    """

    kind = "disk"

    def __init__(self, formats: dict[int, ExpertFormat], reader: FileReader, capacity: int, readers: int = READERS):
        self.formats, self.reader, self.capacity = formats, reader, capacity
        self.entries: OrderedDict[tuple[int, int], tuple[torch.Tensor, ...]] = OrderedDict()  # (gate, up, down)
        self.inflight: dict[tuple[int, int], Future] = {}
        self.pool = ReadQueue(self._fetch, readers)
        self.readers = max(1, readers)
        self.held = 0
        self.hits = self.misses = 0
        self.read_ahead = 0  # reads started from a prediction, before the layer asked
        self.cancelled = 0  # reads ahead dropped before they started: the layer asked for others
        self.ahead: dict[tuple[int, int], bool] = {}  # read ahead and not used yet
        self.ahead_used = 0  # uses served by a read ahead (the first use after it)
        self.used_bytes = 0  # expert bytes of the reads a use needed (misses and reads ahead used): not wasted
        self.demand: dict[tuple[int, int], bool] = {}  # read because a layer asked, not used yet: a miss
        self.wait_s = 0.0  # time compute threads waited for a read
        self.reading = self.max_reading = 0  # reads in progress now / at most
        self._lock = threading.Lock()
        # each read's buffer: the layer's expert bytes plus the slack the plan counts for them
        self._sizes = {layer: fmt.nbytes + read_slack(fmt.nbytes) for layer, fmt in formats.items()}
        spare_room = SPARES * max(self._sizes.values(), default=0)
        self._keep_spares = capacity >= 4 * spare_room > 0  # a small cache frees its buffers instead
        self._room = capacity - spare_room if self._keep_spares else capacity  # for cached experts
        self._spare_room = spare_room if self._keep_spares else 0
        self._spares: list[np.ndarray] = []  # evicted experts' buffers, maybe still in use
        self._owners: dict[tuple[int, int], np.ndarray] = {}  # a cached expert's buffer
        self._spare_reads = 0  # reads into a kept buffer (outside the arena)
        # the cache's memory, populated from now on (a small cache frees its buffers instead)
        self.arena = _arena(capacity) if self._keep_spares else None

    def request(self, layer: int, experts, ahead: bool = False) -> None:
        """Start reading each of `experts` that is neither cached nor being read; returns at once. A
        layer's own request (not `ahead`) settles the reads ahead for it: those it does not ask for
        were wrong predictions, no longer waiting for a use, and those not started yet are dropped."""
        with self._lock:
            if not ahead and self.ahead:
                asked = {int(e) for e in experts}
                for key in [k for k in self.ahead if k[0] == layer and k[1] not in asked]:
                    del self.ahead[key]
                    if key in self.inflight and self.pool.cancel(key):
                        del self.inflight[key]
                        self.read_ahead -= 1
                        self.cancelled += 1
            for e in experts:
                key = (layer, int(e))
                if key in self.entries:
                    continue
                if key in self.inflight:
                    if not ahead:
                        self.pool.promote(key)
                    continue
                self.inflight[key] = self.pool.submit(key, urgent=not ahead)
                if ahead:
                    self.read_ahead += 1
                    self.ahead[key] = True
                else:
                    self.demand[key] = True

    def arrival(self, layer: int, experts):
        """`experts` in the order their bytes are here: cached first, then reads as they finish
        (anything neither cached nor being read last), so compute never waits on one read while
        another has landed. Holds expert ids only, never a read's future (whose result would keep
        an evicted expert's bytes alive). Counts nothing: `parts` does."""
        landed: queue.SimpleQueue = queue.SimpleQueue()
        here, pending = [], 0
        with self._lock:
            for e in experts:
                future = self.inflight.get((layer, e))
                if (layer, e) in self.entries or future is None:
                    here.append(e)
                else:
                    future.add_done_callback(lambda _f, e=e: landed.put(e))
                    pending += 1
        yield from here
        for _ in range(pending):
            t0 = time.perf_counter()
            e = landed.get()
            with self._lock:
                self.wait_s += time.perf_counter() - t0
            yield e

    def parts(self, layer: int, e: int) -> tuple[torch.Tensor, ...]:
        key = (layer, e)
        with self._lock:
            flat = self.entries.get(key)
            self._count_use(key, cached=flat is not None)
            if flat is not None:
                self.entries.move_to_end(key)
                return flat
            future = self.inflight.get(key)
            if future is None:
                future = self.inflight[key] = self.pool.submit(key, urgent=True)
            else:
                self.pool.promote(key)
        t0 = time.perf_counter()
        flat = future.result()
        with self._lock:
            self.wait_s += time.perf_counter() - t0
        return flat

    def _count_use(self, key: tuple[int, int], cached: bool) -> None:
        """A use is the first after a read ahead (a prediction's read, landed or not: not a cache hit),
        a miss (read for this use, landed or not, or not read yet) or a hit (cached before it was
        asked for). Under the lock."""
        ahead = self.ahead.pop(key, False)
        demand = self.demand.pop(key, False)
        if ahead:
            self.ahead_used += 1
        elif demand or not cached:
            self.misses += 1
        else:
            self.hits += 1
            return
        self.used_bytes += self.formats[key[0]].nbytes  # a read this use needed: not wasted

    def _fetch(self, key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        with self._lock:
            self.reading += 1
            self.max_reading = max(self.max_reading, self.reading)
        try:
            flat = self._read(*key)
        except BaseException:
            with self._lock:
                self.inflight.pop(key, None)  # a later use retries the read instead of the stale error
            raise
        finally:
            with self._lock:
                self.reading -= 1
        with self._lock:
            self._insert(key, flat)
            self.inflight.pop(key, None)
        return flat

    def _read(self, layer: int, e: int) -> torch.Tensor:
        fmt = self.formats[layer]
        spans = [(p.offset + e * p.nbytes, p.nbytes) for p in fmt.parts]
        if not self._keep_spares:
            return self.reader.read_spans(spans)
        buf = self._buffer(self._sizes[layer])
        try:
            flat = self.reader.read_spans(spans, torch.from_numpy(buf))
        except BaseException:
            if self.arena is not None:  # else an arena buffer per failed read was lost for good
                self.arena.give(buf)
            raise
        with self._lock:
            self._owners[(layer, e)] = buf
        return flat

    @property
    def spare_reads(self) -> int:
        """Reads into a kept buffer: an evicted expert's, nothing viewing it any more."""
        return self._spare_reads + (self.arena.reused if self.arena is not None else 0)

    def _buffer(self, size: int) -> np.ndarray:
        """A buffer of `size` bytes from the arena, else a kept buffer that no tensor views any
        more, else a new one. Every view of a buffer shares one torch storage, which holds one
        reference to the array: an array only this list refers to is free."""
        if self.arena is not None:
            buf = self.arena.take(size)
            if buf is not None:
                return buf
        with self._lock:
            for i in range(len(self._spares)):
                if self._spares[i].nbytes == size and sys.getrefcount(self._spares[i]) == 2:
                    self._spare_reads += 1
                    return self._spares.pop(i)
        return np.empty(size, dtype=np.uint8)

    def _insert(self, key, flat: tuple[torch.Tensor, ...]) -> None:
        if key in self.entries:
            return
        self.entries[key] = flat
        self.held += _held(flat)
        room = self._room_now()
        while self.held > room and len(self.entries) > 1:
            gone = self._victim(spare_unused=self.arena is not None and self.arena.populating)
            if gone is None:
                break
            old = self.entries.pop(gone)
            self.held -= _held(old)
            buf = self._owners.pop(gone, None)
            if buf is not None and self.arena is not None and self.arena.owns(buf):
                self.arena.give(buf)
            elif buf is not None and len(self._spares) < SPARES:
                self._spares.append(buf)
            self.ahead.pop(gone, None)  # a read ahead evicted unused: a wasted read
            self.demand.pop(gone, None)

    def wide_forward(self, wide: bool) -> None:
        """A prompt's forward (`wide`) or a decode step's starts: the arena's populating thread waits
        through a prompt, whose compute wants both cores (py-spy: 5.8 s of CPU populating beside the
        full-size flagship's first prompt, 32 tokens), and populates during decode, which waits on
        the disk. The cache meanwhile holds what is populated."""
        if self.arena is not None:
            self.arena.pause(wide)

    def _room_now(self) -> int:
        """The bytes the cache may hold now. While its arena is still being populated, only what is
        populated (less the reads in flight's share): a read then reuses an evicted expert's
        buffer instead of faulting fresh pages in, which on a virtual machine whose host backs
        free memory again page by page took 16 % of the CPU samples (perf) of a full-size flagship
        run with a 32-token prompt, inside the readers' O_DIRECT reads; so the cache grows at the
        populating thread's pace, off the readers' path."""
        if self.arena is None:
            return self._room
        return min(self._room, self.arena.ready - self._spare_room)

    def _victim(self, spare_unused: bool):
        """The least recently used entry; while the room is only what is populated, not one read for a
        layer (or ahead for it) that has not used it yet (evicting it would read it twice)."""
        if not spare_unused:
            return next(iter(self.entries))
        return next((k for k in self.entries if k not in self.demand and k not in self.ahead), None)

    def close(self) -> None:
        self.pool.shutdown()
        if self.arena is not None:
            self.arena.close()

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def stats(self) -> dict:
        total = self.hits + self.misses + self.ahead_used
        return {"home": "disk", "ram_cache_bytes": self.capacity, "ram_cache_held": self.held,
                "ram_cache_hits": self.hits, "disk_reads": self.misses + self.read_ahead,
                "ram_cache_hit_rate": self.hits / total if total else 0.0,
                "read_ahead_used": self.ahead_used, "read_ahead_cancelled": self.cancelled,
                "read_ahead_in_time": self.ahead_used / total if total else 0.0,
                "bytes_read": self.reader.bytes_read, "device_bytes_read": self.reader.device_bytes,
                "bytes_used": self.used_bytes,
                "o_direct": self.reader.direct, "readers": self.readers, "read_ahead": self.read_ahead,
                "max_reads_in_flight": self.max_reading, "read_wait_s": self.wait_s,
                "read_busy_s": self.reader.busy_s,
                "reads_into_kept_buffers": self.spare_reads,
                "ram_cache_populated": self.arena.populated if self.arena is not None else 0}
