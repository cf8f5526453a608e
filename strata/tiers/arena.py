"""The memory of a disk home's RAM cache: one anonymous mapping, populated once in the background.

A disk home reads each expert into a buffer of its own. The first touch of a fresh anonymous page
is a page fault, and where the host reclaims a virtual machine's free memory (free page reporting)
each fault also waits for the host to back the page again: 5-11 us a 4 KiB page there, against
1.4-2 us on memory still backed. The full-size flagship's first prompt filled its 3.2 GiB cache
with 837,000 such faults inside the readers' O_DIRECT reads, 6.9 s of its 13 s of prefill CPU.

Here the cache's bytes are one mapping whose pages a thread populates from the start
(`madvise(MADV_POPULATE_WRITE)` in chunks: no fault per page), and the buffers handed out come
from its populated front, so the cache (`DiskHome`) holds what is populated so far and its reads
reuse evicted experts' buffers meanwhile. The thread is paused through a prompt's forwards: beside
them it doubled the full-size flagship's first prompt (32 tokens: 15.5-16.1 s against 8.3-9.4 s
paused, 20.5-21.3 s of CPU against 11.5-12.6; populating at low priority, SCHED_IDLE, was as slow,
18 s to the first token), so it populates while decode waits on the disk (alone 0.6-2.0 s a GiB,
by how long the host has had the memory back; about 0.27 GiB a second beside the flagship's decode). A buffer comes back when its expert is evicted and is
handed out again once nothing views it; nothing is returned to the OS, so the cache's memory is
populated once per process.
"""

from __future__ import annotations

import mmap
import sys
import threading

import numpy as np

from strata.madvise import MADV_POPULATE_WRITE, madvise as _madvise

PAGE = mmap.PAGESIZE
# bytes per madvise call: the call holds the process's memory-map lock, and a thread waiting to map
# or unmap memory makes every fault behind it wait too (32 MiB calls on a low-priority thread made
# the readers block 160,000 times in one prompt)
POPULATE_CHUNK = 2 * 2**20


class Arena:
    """`nbytes` of anonymous memory carved into buffers (`take`) that come back (`give`).

    `take(size)` is a free buffer of exactly `size` bytes, else one carved from the mapping's
    populated front, else a free larger one (whole: its size is what it holds), else one carved
    past the populated front (its read faults its pages in), else None (the caller allocates its
    own). `ready` is how many bytes a cache can hold without a read faulting a page: what the
    populating thread has done so far (all of it once done, or where it cannot populate). A given-back
    buffer is free once only the arena refers to it (every torch view of a buffer shares one
    storage, which holds one reference to the array)."""

    def __init__(self, nbytes: int, populate: bool = True):
        self.nbytes = max(0, int(nbytes)) // PAGE * PAGE
        # private: anonymous memory (RssAnon, what --ram-memory bounds); a shared mapping would be
        # shmem, outside that count, and its pages fault in slower
        self._map = mmap.mmap(-1, max(self.nbytes, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self._bytes.ctypes.data
        self._lock = threading.Lock()
        self._carved = 0  # bytes handed out from the start so far
        self._free: dict[int, list[np.ndarray]] = {}  # size -> buffers nothing views
        self._back: list[np.ndarray] = []  # given back, maybe still viewed
        self.reused = 0  # buffers handed out again
        self.populated = 0  # bytes from the start the populating thread has faulted in (or skipped)
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared while `pause`d
        self._go.set()
        self._thread = None
        self._populating = populate and self.nbytes > 0
        if self._populating:
            self._thread = threading.Thread(target=self._populate, name="strata-arena-populate", daemon=True)
            self._thread.start()

    @property
    def populating(self) -> bool:
        """Whether the populating thread is still at work (then only `ready` bytes are populated)."""
        return self._populating

    @property
    def ready(self) -> int:
        return self.populated if self._populating else self.nbytes

    def owns(self, buf: np.ndarray) -> bool:
        return self.base <= buf.ctypes.data < self.base + self.nbytes

    def take(self, size: int) -> np.ndarray | None:
        with self._lock:
            self._collect()
            free = self._free.get(size)
            if free:
                self.reused += 1
                return free.pop()
            span = -(-size // PAGE) * PAGE
            if self._carved + span <= self.ready:
                return self._carve(size, span)
            larger = [s for s, bufs in self._free.items() if s > size and bufs]
            if larger:
                self.reused += 1
                return self._free[min(larger)].pop()
            if self._carved + span <= self.nbytes:
                return self._carve(size, span)
        return None

    def _carve(self, size: int, span: int) -> np.ndarray:
        buf = self._bytes[self._carved:self._carved + size]
        self._carved += span
        return buf

    def give(self, buf: np.ndarray) -> None:
        """An evicted expert's buffer (ignored when it is not the arena's)."""
        if self.owns(buf):
            with self._lock:
                self._back.append(buf)

    def _collect(self) -> None:
        """Given-back buffers that nothing views any more become free (under the lock)."""
        back, keep = self._back, []
        for i in range(len(back)):
            if sys.getrefcount(back[i]) == 2:  # the list's reference and the call's
                self._free.setdefault(back[i].nbytes, []).append(back[i])
            else:
                keep.append(back[i])
        self._back = keep

    def _populate(self) -> None:
        try:
            self._populate_all()
        finally:
            self._populating = False  # done, stopped, or unable: every byte counts as ready

    def _populate_all(self) -> None:
        madvise = _madvise()
        if madvise is None:
            return
        while not self._stop.is_set():
            self._go.wait()
            with self._lock:  # buffers already handed out are faulted by their own reads
                start = max(self.populated, self._carved // POPULATE_CHUNK * POPULATE_CHUNK)
            if start >= self.nbytes:
                break
            n = min(POPULATE_CHUNK, self.nbytes - start)
            if madvise(self.base + start, n, MADV_POPULATE_WRITE) != 0:
                break  # an older kernel: pages fault in on first use, as without the arena
            self.populated = start + n

    def pause(self, paused: bool) -> None:
        """Hold the populating thread (between chunks) while the CPU is wanted elsewhere, or let it go on."""
        if paused:
            self._go.clear()
        else:
            self._go.set()

    def close(self) -> None:
        """Stop populating (the mapping itself goes with the last buffer)."""
        self._stop.set()
        self._go.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
