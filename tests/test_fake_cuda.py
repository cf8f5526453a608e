"""A decode step on the device reads nothing back, checked without a GPU: fake device tensors.

Under torch's `FakeTensorMode` tensors carry a device, shape and dtype but no data. Any read of
values (`.item()`, `.tolist()`, `bool(t)`, an op whose output shape depends on the data such as a
boolean index or `unique`) raises, and so does an op mixing devices. The device is "meta": on this
CPU-only build (torch 2.13.0+cpu) fake "cuda" tensors pass simple ops but every op whose binding
takes a device guard (`copy_`, `cat`, index assignment, a strided `.float()`) raises "not linked
with support for cuda devices", while fake meta tensors behave as a device without data would.
The engine code treats any non-CPU device as the accelerator, so the same paths run. `Copies` below also records every cross-device copy: a device-to-host copy is a
read, and a host-to-device copy that is not `non_blocking` waits for the device queue too.

Each architecture's model is placed whole on fake cuda:0 (embedding, blocks, experts, head) and
runs two decode steps: no read, no blocking copy. Then the tiered path: every MoE layer served
by the hybrid executor with its experts in RAM, computed by the CPU lane; the step's only reads
are the routing reads, one per MoE layer, through `HybridExecutor.read_host`, which the test
replaces (fake tensors have no values to return) with one that counts and hands back host data.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

import strata
from strata.kernels.gpu import ops  # noqa: F401  (registers torch.ops.strata.* before the fake mode)
from strata.models.layers import Experts
from strata.loader import load_model
from strata.models.seams import Seams
from strata.tiers.ngram_table import open_table
from strata.tiers.placement import BlockPlacement, move_tensors, place_blocks
from test_dtypes import tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEVICE = torch.device("meta")  # the accelerator stand-in (see above)
ARCHS = ["llama", "mixtral", "qwen3moe", "qwen3next", "qwen4exp"]


class FakeCuda(FakeTensorMode):
    """Fake device tensors beside real host ones: an op on host tensors only (step bookkeeping, the
    CPU lane's inputs) runs for real, as on a machine with a GPU; anything touching a device tensor
    is fake, so a value derived from the device (even copied to the host) cannot be read. Also
    records cross-device copies: (source device, target device, non_blocking)."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.seen: list[tuple[str, str, bool, str]] = []
        self.recording = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.recording:
            self._record(func, args, kwargs)
        if _host_only(args, kwargs):
            with _disable_current_modes():
                return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record(self, func, args, kwargs):
        if func is torch.ops.aten._to_copy.default and "device" in kwargs:
            src, dst = args[0].device, torch.device(kwargs["device"])
            if src.type != dst.type:
                self.seen.append((src.type, dst.type, bool(kwargs.get("non_blocking", False)), _caller()))
        elif func is torch.ops.aten.copy_.default and args[0].device.type != args[1].device.type:
            self.seen.append((args[1].device.type, args[0].device.type, bool(kwargs.get("non_blocking", False)),
                              _caller()))

    @property
    def reads(self) -> list:
        return [c for c in self.seen if c[0] != "cpu"]

    @property
    def blocking_writes(self) -> list:
        return [c for c in self.seen if c[0] == "cpu" and not c[2]]


def _caller() -> str:
    """The innermost engine line on the stack: where a copy was asked for."""
    frames = [f for f in traceback.extract_stack() if "/strata/" in f.filename]
    return f"{frames[-1].filename.split('/strata/')[-1]}:{frames[-1].lineno}" if frames else "?"


def _host_only(args, kwargs) -> bool:
    leaves = tree_leaves((args, kwargs))
    if any(isinstance(t, FakeTensor) for t in leaves):
        return False
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


@pytest.fixture(scope="module", params=ARCHS)
def model_file(request, tmp_path_factory):
    return request.param, tiny_checkpoint(request.param, tmp_path_factory)[1]


class _AllOnDevice:
    """A plan that homes every tensor on the device."""

    def __init__(self, names):
        self.homes = {n: "gpu" for n in names}


def _decode_twice(model, cache) -> torch.Tensor:
    with torch.no_grad():  # not inference_mode: fake tensors refuse host-to-device copies in it
        for token in (7, 9):
            logits = model(torch.tensor([[token]]), cache, last_only=True)
    return logits


def test_resident_decode_step_reads_nothing_back(model_file):
    name, path = model_file
    engine = load_model(path, torch.bfloat16, seams=Seams(table_reader=open_table, placement=BlockPlacement()))
    model = engine.model
    with FakeCuda() as copies:
        place_blocks(model, _AllOnDevice(engine.source.names()), DEVICE)
        for m in model.modules():
            if isinstance(m, Experts):
                b = m.backend
                b.gate, b.up, b.down = b.gate.to(DEVICE), b.up.to(DEVICE), b.down.to(DEVICE)
        cache = model.new_cache(1)
        copies.recording = True
        logits = _decode_twice(model, cache)
    assert logits.device == DEVICE and logits.shape == (1, 1, engine.config.vocab_size)
    assert copies.reads == [], f"{name}: device-to-host copies in a resident decode step: {copies.reads}"
    assert copies.blocking_writes == [], f"{name}: blocking host-to-device copies: {copies.blocking_writes}"


def test_tiered_decode_step_reads_routing_once_per_moe_layer(model_file):
    name, path = model_file
    if name == "llama":
        pytest.skip("dense: no MoE layer to tier")
    engine = strata.load(path, dtype="bfloat16", pin_experts="ram", experts_cache="0", prefetch=True)
    model, executor = engine.model, engine.tiers.executor
    n_moe = sum(isinstance(m, Experts) for m in model.modules())
    predictors = engine.tiers.prefetcher.predictors
    predicted_layers = sum(layer - 1 in predictors for layer in predictors)  # MoE layers after an MoE layer
    k = engine.config.n_experts_used
    reads, riders = [], []

    def read_host(x, ids, weights, *more):  # the device would return the values: hand back host data of that shape
        reads.append(tuple(ids.shape))
        g = torch.Generator().manual_seed(len(reads))
        ids_h, *more_h = (torch.stack([torch.randperm(engine.config.n_experts, generator=g)[:k] for _ in range(t.shape[0])])
                          for t in (ids, *more))
        riders.extend(t.shape for t in more_h)
        return (torch.randn(x.shape, generator=g).to(x.dtype), ids_h, torch.full(weights.shape, 1 / k, dtype=weights.dtype),
                *more_h)

    executor.read_host = read_host
    executor.device = DEVICE  # what `hardware.device_info()` names on a machine with a GPU
    with FakeCuda() as copies:
        move_tensors(model, DEVICE, skip={id(m) for m in model.modules() if isinstance(m, Experts)})
        place_blocks(model, _AllOnDevice(engine.loaded.source.names()), DEVICE)
        cache = model.new_cache(1)
        copies.recording = True
        logits = _decode_twice(model, cache)
    assert logits.device == DEVICE
    assert len(reads) == 2 * n_moe, f"{name}: {len(reads)} routing reads for {n_moe} MoE layers x 2 steps"
    assert executor.host_reads == 2 * n_moe
    # the prefetcher's next-layer predictions ride on those reads, one per predicted layer and step
    assert len(riders) == 2 * predicted_layers and predicted_layers >= 1, f"{name}: {len(riders)} riders"
    assert engine.tiers.executor.stats.as_dict({})["total"]["predicted"] == 2 * predicted_layers * k
    assert copies.reads == [], f"{name}: reads besides the routing reads: {copies.reads}"
    assert copies.blocking_writes == [], f"{name}: blocking host-to-device copies: {copies.blocking_writes}"
