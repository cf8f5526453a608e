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


class SlotMemory:
    """`n` slots of `slot_bytes` on `device`; writes are ordered after the reads before them."""

    def __init__(self, n: int, slot_bytes: int, device: torch.device):
        self.device = device
        self.data = torch.empty((n, slot_bytes), dtype=torch.uint8, device=device)  # (slots, bytes)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def write(self, slot: int, fmt: ExpertFormat, parts) -> object | None:
        """Copy an expert's parts into `slot`; on CUDA returns the event marking the copy's end."""
        dst = fmt.split(self.data[slot])
        if self.stream is None:
            for d, s in zip(dst, parts):
                d.copy_(s)
            return None
        # do not overwrite a slot a queued kernel may still read
        self.stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self.stream):
            for d, s in zip(dst, parts):
                d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def parts(self, slot: int, fmt: ExpertFormat):
        return fmt.split(self.data[slot])


class Copier:
    """Issues slot writes on one background thread; `ready(slot)` waits for the last one."""

    def __init__(self, memory: SlotMemory, homes: dict, formats: dict[int, ExpertFormat]):
        self.memory, self.homes, self.formats = memory, homes, formats
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="strata-copy")
        self.pending: dict[int, Future] = {}
        self.bytes_copied = 0

    def submit(self, slot: int, layer: int, e: int) -> None:
        self.pending[slot] = self.pool.submit(self._copy, slot, layer, e)
        self.bytes_copied += self.formats[layer].nbytes

    def _copy(self, slot: int, layer: int, e: int):
        return self.memory.write(slot, self.formats[layer], self.homes[layer].parts(layer, e))

    def ready(self, slot: int) -> None:
        fut = self.pending.pop(slot, None)
        if fut is None:
            return
        event = fut.result()
        if event is not None:
            torch.cuda.current_stream(self.memory.device).wait_event(event)

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

    def request(self, keys: list[int], prefill: bool) -> tuple[list[int], list[int], list[int]]:
        """(hits, copied in, left to the CPU) for one step's experts."""
        hits, copies, rejected = self.slots.request(keys, prefill)
        self._copy_in(copies)
        return hits, [k for k, _ in copies], rejected

    def prefetch(self, keys: list[int], prefill: bool = False) -> list[int]:
        """Copy predicted experts in ahead of use."""
        copies = self.slots.prefetch(keys, prefill)
        self._copy_in(copies)
        return [k for k, _ in copies]

    def preload(self) -> None:
        """Static hot sets known up front are copied in at start."""
        self._copy_in(self.slots.preload())

    def _copy_in(self, copies) -> None:
        for key, slot in copies:
            self.copier.submit(slot, *divmod(key, self.n_experts))

    def parts(self, key: int, fmt: ExpertFormat):
        slot = self.where[key]
        self.copier.ready(slot)
        return self.memory.parts(slot, fmt)

    def resident_per_layer(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for key in self.where:
            out[key // self.n_experts] = out.get(key // self.n_experts, 0) + 1
        return out
