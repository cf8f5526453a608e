"""The device cache's pinned staging: a bounded ring, a buffer reused only after its copy finished."""

from __future__ import annotations

from strata.tiers.device_cache import STAGING_SLOTS, SlotMemory, Staging


class _Event:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_staging_ring_is_bounded_and_waits_for_the_copy_out_of_a_buffer():
    ring = Staging(2, 64, pin=False)
    first, buf0 = ring.take()
    ring.events[first] = event = _Event()
    second, buf1 = ring.take()
    assert (first, second) == (0, 1) and buf0.data_ptr() != buf1.data_ptr()
    again, buf = ring.take()  # back to buffer 0: its copy must be done before it is refilled
    assert again == 0 and buf.data_ptr() == buf0.data_ptr() and event.waited == 1
    assert ring.events[0] is None and len(ring.buffers) == 2


def test_cpu_slot_memory_stages_nothing():
    import torch

    memory = SlotMemory(4, 128, torch.device("cpu"))
    assert memory.staging is None and memory.stream is None and STAGING_SLOTS <= 64


def test_slot_writes_wait_for_the_mark_taken_when_they_were_issued():
    """A demand copy waits for a mark of the compute work queued when the step asked for it; a
    prefetch's copies for the mark the executor took after the layer's kernels (`after`), not for
    whatever is queued by the time the copier thread runs (the next layer's attention)."""
    import torch

    from strata.tiers.device_cache import Copier, DeviceCache
    from strata.tiers.policy import make_policy, regions
    from strata.tiers.store import expert_format
    from strata.formats.weights import QTensor
    from gguf import GGMLQuantizationType as T

    class Marks(SlotMemory):
        def __init__(self):
            super().__init__(4, 3 * 4 * 8 * 4, torch.device("cpu"))
            self.marks, self.waits = 0, []

        def mark(self):
            self.marks += 1
            return f"mark {self.marks}"

        def write(self, slot, fmt, parts, after=None):
            self.waits.append(after)
            return super().write(slot, fmt, parts, after)

    stacked = [QTensor(torch.zeros(8, 4 * 8 * 4, dtype=torch.uint8), T.F32, (8, 4, 8)) for _ in range(3)]
    fmt = expert_format(stacked)

    class Home:
        kind = "ram"

        def parts(self, layer, e):
            return tuple(q.raw[e] for q in stacked)

    memory = Marks()
    copier = Copier(memory, {0: Home()}, {0: fmt})
    cache = DeviceCache(memory, copier, regions(make_policy("lru", 4, 8, "always", 8, None), 0), 8)
    cache.request([0, 1], False)
    [f.result() for f in copier.pending.values()]
    assert memory.waits == ["mark 1", "mark 1"]  # one mark for the step's two copies, taken at the request
    cache.prefetch([2], after="after layer 0's kernels")
    [f.result() for f in copier.pending.values()]
    assert memory.waits[-1] == "after layer 0's kernels" and memory.marks == 1
    copier.close()
