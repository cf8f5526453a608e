"""The device expert cache: fixed slots of one expert each (gate + up + down bytes).

On CUDA the slots are one device tensor filled from pinned RAM on a separate copy stream;
without CUDA the same slots live in CPU memory and a background thread stands in for the
stream, so the tests run the very code the GPU runs. Keys are `layer * n_experts + e`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from strata.tiers.policy import Region, SlotMap
from strata.tiers.store import ExpertFormat


STAGING_SLOTS = 16  # pinned staging buffers of one expert each: what is page-locked, not the whole home


class Staging:
    """A bounded ring of pinned host buffers, one expert each. An expert's parts are gathered into
    the next buffer, which goes to the device in one asynchronous copy; a buffer is refilled only
    after the copy out of it has finished (its event), so at most `n` copies are in flight."""

    def __init__(self, n: int, nbytes: int, pin: bool):
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(n)]
        self.events: list = [None] * n
        self.next = 0

    def take(self) -> tuple[int, torch.Tensor]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.events[i] is not None:
            self.events[i].synchronize()  # the copier thread waits for its own old copy, never the compute
            self.events[i] = None
        return i, self.buffers[i]


class SlotMemory:
    """`n` slots of `slot_bytes` on `device`; writes are ordered after the reads before them.

    On CUDA a write runs on a side stream: it first waits for the compute stream (a queued kernel
    may still read the slot being overwritten), gathers the expert into a pinned staging buffer and
    copies it over in one transfer; the event it returns is what a reader waits on, on the same
    compute stream (`compute`, the stream the model runs on, taken when the cache is built)."""

    def __init__(self, n: int, slot_bytes: int, device: torch.device):
        self.device = device
        self.data = torch.empty((n, slot_bytes), dtype=torch.uint8, device=device)  # (slots, bytes)
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.compute = torch.cuda.current_stream(device) if cuda else None
        self.staging = Staging(min(STAGING_SLOTS, max(n, 1)), slot_bytes, pin=True) if cuda else None

    def mark(self):
        """An event after the compute work queued so far (on CUDA; else None), taken when a copy is
        issued: its slot write waits for exactly that work, not for what is queued later (the next
        layer's attention, which the copy is meant to overlap)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.compute)
        return event

    def write(self, slot: int, fmt: ExpertFormat, parts, after=None) -> object | None:
        """Copy an expert's parts into `slot` once `after` (a `mark`) has passed; on CUDA returns
        the event marking the copy's end."""
        if self.stream is None:
            for d, s in zip(fmt.split(self.data[slot]), parts):
                d.copy_(s)
            return None
        i, buf = self.staging.take()
        for d, s in zip(fmt.split(buf), parts):  # host to pinned host: a memcpy on this thread
            d.copy_(s)
        if after is not None:  # do not overwrite a slot a queued kernel may still read
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(self.compute)
        with torch.cuda.stream(self.stream):
            self.data[slot, :fmt.nbytes].copy_(buf[:fmt.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.staging.events[i] = event
        return event

    def wait(self, event) -> None:
        """Make the compute stream wait for a slot's copy (the host does not wait)."""
        if event is not None:
            self.compute.wait_event(event)

    def parts(self, slot: int, fmt: ExpertFormat):
        return fmt.split(self.data[slot])


class Copier:
    """Issues slot writes on one background thread; `ready(slot)` waits for the last one."""

    def __init__(self, memory: SlotMemory, homes: dict, formats: dict[int, ExpertFormat]):
        self.memory, self.homes, self.formats = memory, homes, formats
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="strata-copy")
        self.pending: dict[int, Future] = {}
        self.bytes_copied = 0

    def submit(self, slot: int, layer: int, e: int, after=None) -> None:
        self.pending[slot] = self.pool.submit(self._copy, slot, layer, e, after)
        self.bytes_copied += self.formats[layer].nbytes

    def _copy(self, slot: int, layer: int, e: int, after=None):
        return self.memory.write(slot, self.formats[layer], self.homes[layer].parts(layer, e), after)

    def ready(self, slot: int) -> None:
        fut = self.pending.pop(slot, None)
        if fut is None:
            return
        self.memory.wait(fut.result())

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class DeviceCache:
    """Slots in device memory, filled as `SlotMap` decides; `request` splits a step's experts."""

    def __init__(self, memory: SlotMemory, copier: Copier, regions: list[Region], n_experts: int):
        self.memory, self.copier = memory, copier
        self.slots = SlotMap(regions, n_experts)
        self.n_experts = n_experts

    @property
    def where(self) -> dict[int, int]:
        return self.slots.where

    @property
    def regions(self) -> list[Region]:
        return self.slots.regions

    def request(self, keys: list[int], prefill: bool, served: list[int] | None = None
                ) -> tuple[list[int], list[int], list[int]]:
        """(hits, copied in, left to the CPU) for one step's experts (`served`: token-routings each)."""
        hits, copies, rejected = self.slots.request(keys, prefill, served)
        self._copy_in(copies)
        return hits, [k for k, _ in copies], rejected

    def prefetch(self, keys: list[int], prefill: bool = False, after=None) -> list[int]:
        """Copy predicted experts in ahead of use; `after`: the event their writes wait for."""
        copies = self.slots.prefetch(keys, prefill)
        self._copy_in(copies, after)
        return [k for k, _ in copies]

    def preload(self) -> None:
        """Static hot sets known up front are copied in at start."""
        self._copy_in(self.slots.preload())

    def _copy_in(self, copies, after=None) -> None:
        if copies and after is None:
            after = self.memory.mark()  # the work queued up to now is what may read the slots replaced
        for key, slot in copies:
            self.copier.submit(slot, *divmod(key, self.n_experts), after)

    def mark(self):
        """See `SlotMemory.mark`."""
        return self.memory.mark()

    def parts(self, key: int, fmt: ExpertFormat):
        slot = self.where[key]
        self.copier.ready(slot)
        return self.memory.parts(slot, fmt)

    def resident_per_layer(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for key in self.where:
            out[key // self.n_experts] = out.get(key // self.n_experts, 0) + 1
        return out
