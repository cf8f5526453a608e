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
