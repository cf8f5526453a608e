"""What a model is built with: the seams the tiers plug into, passed at construction.

As mlx-lm passes its cache to the model and nano-vllm its context, a model here takes a `Seams`:
- `experts`, an `ExpertsProvider`: each MoE layer hands it its stacked experts while the model is
  built and gets back what computes them; the forward loop tells it when a block starts.
- `kv_cache`, a `KVCacheFactory`: attention -> that layer's cache (None: the plain caches).
- `table_reader`, a `TableReader`: opens the n-gram table of a PLE layer (qwen4exp).
- `placement`, a `Placement`: which device each block's inputs and the head's input must be on.
Nothing is assigned onto a model after it is built; the defaults are the all-resident model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch

from strata.formats.weights import QTensor
from strata.models.cache import StepInfo
from strata.models.layers import ResidentExperts


@runtime_checkable
class ExpertLayer(Protocol):
    """One MoE layer's routed experts: y = experts(x, ids, weights) for x (N, hidden), ids/weights (N, k)."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class ExpertsProvider(Protocol):
    """Computes a model's routed experts: resident here, tiered in `strata.tiers`."""

    def layer(self, index: int, gate: QTensor, up: QTensor, down: QTensor) -> ExpertLayer:
        """Called once per MoE layer while the model is built, with its stacked `[E, out, in]` experts."""
        ...

    def begin_block(self, index: int, x: torch.Tensor, step: StepInfo) -> None:
        """Called by the forward loop before block `index` runs on x (step bookkeeping, prefetch)."""
        ...


@runtime_checkable
class Placement(Protocol):
    """Where each block runs: the forward loop moves a block's inputs, and the head's, through it."""

    def block_inputs(self, index: int, x: torch.Tensor, step: StepInfo, rope_cs) -> tuple:
        """(x, step, rope_cs) on block `index`'s device."""
        ...

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        """The last hidden state on the output head's device."""
        ...


KVCacheFactory = Callable[[torch.nn.Module], object]  # attention layer -> its cache
TableReader = Callable[..., object]  # (source, hash, row_dim, rows) -> an n-gram table


class Resident:
    """The plain `ExpertsProvider`: every expert resident, nothing to do between blocks."""

    def layer(self, index: int, gate: QTensor, up: QTensor, down: QTensor) -> ResidentExperts:
        return ResidentExperts(gate, up, down)

    def begin_block(self, index: int, x: torch.Tensor, step: StepInfo) -> None:
        pass


class InPlace:
    """The plain `Placement`: every block where the model's tensors already are."""

    def block_inputs(self, index: int, x: torch.Tensor, step: StepInfo, rope_cs) -> tuple:
        return x, step, rope_cs

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True, slots=True)
class Seams:
    experts: ExpertsProvider = field(default_factory=Resident)
    kv_cache: KVCacheFactory | None = None
    table_reader: TableReader | None = None
    placement: Placement = field(default_factory=InPlace)
