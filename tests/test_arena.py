"""The RAM cache's arena: buffers carved from one mapping, reused only once nothing views them, and
its pages populated in the background before they are handed out."""

import ctypes
import resource
import sys
import threading
import time

import numpy as np
import pytest
import torch

from strata.tiers import arena as arena_module
from strata.tiers.arena import PAGE, Arena


def test_buffers_are_carved_once_and_reused_only_when_nothing_views_them():
    arena = Arena(4 * PAGE, populate=False)
    a, b = arena.take(PAGE), arena.take(PAGE + 1)  # the second spans two pages
    c = arena.take(PAGE)
    assert arena.take(PAGE) is None  # 4 pages carved: full
    ptrs = [x.ctypes.data for x in (a, b, c)]
    assert len(set(ptrs)) == 3 and all(p % PAGE == 0 and arena.owns(x) for p, x in zip(ptrs, (a, b, c)))
    assert not arena.owns(np.empty(PAGE, dtype=np.uint8))
    view = torch.from_numpy(a)[10:20]  # a worker still computing from an evicted expert
    arena.give(a)
    a = None
    assert arena.take(PAGE) is None  # still viewed: not handed out again
    view = None
    again = arena.take(PAGE)
    assert again is not None and again.ctypes.data == ptrs[0] and arena.reused == 1
    arena.give(b)
    b = None
    larger = arena.take(PAGE)  # no free buffer of its size: a larger one, whole
    assert larger.ctypes.data == ptrs[1] and larger.nbytes == PAGE + 1
    arena.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_its_pages_are_populated_in_the_background_before_they_are_used():
    arena = Arena(64 * PAGE)
    arena._thread.join(10)
    if arena.populated == 0:
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert arena.populated == arena.nbytes
    libc = ctypes.CDLL(None, use_errno=True)
    vec = (ctypes.c_ubyte * 64)()
    assert libc.mincore(ctypes.c_void_p(arena.base), ctypes.c_size_t(arena.nbytes), vec) == 0
    assert all(v & 1 for v in vec)  # every page resident, none of them touched by this process
    buf = arena.take(64 * PAGE)
    assert _faults_writing(buf) < 16  # populated writable: writing its 64 pages faults (almost) none
    arena.close()


def _faults_writing(buf: np.ndarray) -> int:
    """Page faults this thread takes writing one byte in each page of `buf`."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    buf[::PAGE] = 1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RUSAGE_THREAD is Linux's")
def test_an_unpopulated_arena_faults_a_page_per_first_write():
    """The check above can fail: without the populating thread each first write is a fault."""
    arena = Arena(64 * PAGE, populate=False)
    assert _faults_writing(arena.take(64 * PAGE)) >= 60
    arena.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_its_memory_counts_as_the_process_anonymous_memory():
    from strata.tiers.budget import anon_rss

    before = anon_rss()
    arena = Arena(64 * 2**20, populate=False)
    arena.take(arena.nbytes)[::PAGE] = 1
    assert anon_rss() - before >= 60 * 2**20  # RssAnon, which --ram-memory bounds (shmem would not count)
    arena.close()


class _SlowPopulate:
    """madvise for the arena's populating thread that populates `first` chunks, then waits for `go`:
    a virtual machine's host backing pages slower than the reads land."""

    def __init__(self, first: int):
        self.first, self.calls, self.go = first, 0, threading.Event()

    def __call__(self):
        def madvise(addr, n, advice):
            self.calls += 1
            if self.calls > self.first:
                self.go.wait(10)
            return 0
        return madvise


def _slow_arena(monkeypatch) -> tuple[Arena, _SlowPopulate]:
    """A 16-page arena populated in 4-page chunks whose thread is held after its first chunk."""
    slow = _SlowPopulate(first=1)
    monkeypatch.setattr(arena_module, "_madvise", slow)
    monkeypatch.setattr(arena_module, "POPULATE_CHUNK", 4 * PAGE)
    return Arena(16 * PAGE), slow


def test_while_populating_it_hands_out_populated_memory_first(monkeypatch):
    arena, slow = _slow_arena(monkeypatch)
    try:
        _wait_for(lambda: arena.populated == 4 * PAGE)
        assert arena.ready == 4 * PAGE
        a, b = arena.take(2 * PAGE), arena.take(2 * PAGE)  # the populated front
        arena.give(a)
        a = None
        again = arena.take(2 * PAGE)  # a free buffer before any page past the front
        assert again.ctypes.data == arena.base and arena.reused == 1
        past = arena.take(2 * PAGE)  # nothing free: past the front, as without the thread
        assert past is not None and past.ctypes.data == arena.base + 4 * PAGE
    finally:
        slow.go.set()
        arena.close()
    assert arena.ready == arena.nbytes  # the thread is done: every byte counts


def _wait_for(cond, seconds: float = 10.0) -> None:
    stop = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < stop, "timed out"
        time.sleep(0.005)


def test_a_paused_arena_populates_nothing_until_it_goes_on(monkeypatch):
    arena, slow = _slow_arena(monkeypatch)
    try:
        _wait_for(lambda: slow.calls == 2)  # the second chunk's call is under way
        arena.pause(True)  # a prompt's forward begins
        slow.go.set()
        _wait_for(lambda: arena.populated == 8 * PAGE)  # the call under way finishes ...
        time.sleep(0.05)
        assert arena.populated == 8 * PAGE and arena.populating  # ... and no other starts
        arena.pause(False)  # decode
        arena._thread.join(10)
        assert arena.populated == arena.nbytes and not arena.populating
    finally:
        slow.go.set()
        arena.close()
