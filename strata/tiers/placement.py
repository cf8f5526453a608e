"""Put what the plan homes on the device there (`--gpu-layers`): `BlockPlacement`, the model's
placement seam (`strata.models.seams.Placement`), and `place_blocks`, which fills it.

A block whose non-expert weights live on the device has its tensors moved; with every block
there (`--gpu-layers all`, or auto when they fit) the embedding, final norm and output head move
too, so the hidden state never leaves the device in a step. The model's forward loop hands each
block's inputs, and the head's, to its `BlockPlacement`, which moves them to where that block lives
only when they are elsewhere: a copy at each boundary between tiers, none inside one. Step
bookkeeping stays on the host (`StepInfo`): a layer builds its positions and masks on its own device
from it, and rope tables are moved once a step. Experts are not touched: the executor serves them.
Only CUDA needs this; on the CPU-simulated device the blocks already run where they live.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.errors import StrataError
from strata.formats.names import EXPERT_TENSOR
from strata.models.layers import Experts
from strata.models.linear import Embedding, Linear

HEAD_TENSORS = ("token_embd.weight", "output.weight")


class BlockPlacement:
    """The `Placement` seam of a model whose blocks the plan splits between the device and the host:
    block index -> device (none yet: every block where it is), and the head's device."""

    def __init__(self):
        self.devices: dict[int, torch.device] = {}
        self.head: torch.device | None = None
        self.memo: dict = {}  # (id of a step's rope tables, device) -> (those tables, their copies)

    def block_inputs(self, index: int, x: torch.Tensor, step, rope_cs) -> tuple:
        device = self.devices.get(index)
        if device is None:
            return x, step, rope_cs
        key = (id(rope_cs), device)
        if key not in self.memo:
            if len(self.memo) > 8:
                self.memo.clear()
            self.memo[key] = (rope_cs, tuple(t.to(device, non_blocking=True) for t in rope_cs))
        return x.to(device), step.on(device), self.memo[key][1]

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.head is None else x.to(self.head)


def place_blocks(model, plan, device: torch.device, dequantize: dict[str, torch.dtype] | None = None) -> list[int]:
    """Move every block whose attention weights the plan homes on the device, and the embedding and
    head when the plan homes them there too, and record where each block runs in the model's
    `BlockPlacement`; returns the moved blocks' indices. `dequantize`: the dense quantized weights
    (by tensor name) that become floats of that dtype on the device, once (the plan's `dense_forms`);
    the others keep their blocks."""
    placement = model.seams.placement
    if not isinstance(placement, BlockPlacement):
        raise StrataError("the model was built without a BlockPlacement: its blocks cannot be moved",
                          "build it with Seams(placement=BlockPlacement()) (strata.loader.load_with_tiers does)")
    moved = []
    for i, block in enumerate(getattr(model, "blocks", [])):
        here = _block_home(plan, i) == "gpu"
        if here:
            move_tensors(block, device, skip=_experts_of(block), dequantize=dequantize)
            moved.append(i)
        placement.devices[i] = device if here else torch.device("cpu")
    if all(plan.homes.get(n, "gpu") == "gpu" for n in HEAD_TENSORS if n in plan.homes) and moved:
        _place_head(model, device, dequantize)
        placement.head = device
    return moved


def _block_home(plan, i: int) -> str | None:
    """Where block i's non-expert weights live: its attention's, else its first non-expert tensor's."""
    for name in (f"blk.{i}.attn_q.weight", f"blk.{i}.attn_norm.weight"):
        if name in plan.homes:
            return plan.homes[name]
    prefix = f"blk.{i}."
    return next((home for name, home in plan.homes.items()
                 if name.startswith(prefix) and not EXPERT_TENSOR.match(name)), None)


def _place_head(model, device, dequantize) -> None:
    """Embedding, final norm (or mixer) and output projection, plus a draft head reading them."""
    for name in ("tok_embd", "output", "output_norm", "output_mixer"):
        value = getattr(model, name, None)
        if isinstance(value, (Linear, Embedding)):
            value.to_device(device) if isinstance(value, Embedding) else value.to_device(device, _float(value, dequantize))
        elif isinstance(value, nn.Module):
            move_tensors(value, device, dequantize=dequantize)
        elif isinstance(value, torch.Tensor):
            setattr(model, name, value.to(device))
    mtp = getattr(model, "mtp", None)
    if isinstance(mtp, nn.Module):
        move_tensors(mtp, device, dequantize=dequantize)


def _experts_of(block) -> set[int]:
    return {id(m) for m in block.modules() if isinstance(m, Experts)}


def _float(linear: Linear, dequantize: dict[str, torch.dtype] | None) -> torch.dtype | None:
    return (dequantize or {}).get(linear.name) if linear.name is not None else None


def move_tensors(module: nn.Module, device: torch.device, skip: set[int] = frozenset(),
                 dequantize: dict[str, torch.dtype] | None = None) -> None:
    """Parameters, plain tensor attributes and `Linear`/`Embedding` weights (the engine keeps
    weights as all three) of every submodule."""
    for m in module.modules():
        if id(m) in skip:
            continue
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(m, name, value.to(device))
            elif isinstance(value, Linear):  # a quantized weight moves as its blocks, or dequantized once
                value.to_device(device, _float(value, dequantize))
            elif isinstance(value, Embedding):
                value.to_device(device)
        for name, p in list(m.named_parameters(recurse=False)):
            setattr(m, name, nn.Parameter(p.data.to(device), requires_grad=False))
