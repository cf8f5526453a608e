"""Put the blocks the plan homes on the device there (`--gpu-layers`), without touching model code.

A block whose non-expert weights live on the device gets its tensors moved and two hooks:
inputs (hidden state, step bookkeeping, rope tables) go to the device on the way in, the
hidden state comes back on the way out, so neighbouring RAM blocks and the engine's
generate loop see CPU tensors as before. Experts are not touched: the executor serves them.
Only CUDA needs this; on the CPU-simulated device the blocks already run where they live.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.models.cache import StepInfo
from strata.models.linear import Embedding, Linear


class DeviceStep(StepInfo):
    """StepInfo whose index tensors are built on the step's own device."""

    __slots__ = ()

    @property
    def positions(self) -> torch.Tensor:  # (B, T)
        return self.start[:, None] + torch.arange(self.width, device=self.start.device)

    @property
    def token_mask(self) -> torch.Tensor:  # (B, T)
        return torch.arange(self.width, device=self.n_new.device)[None, :] < self.n_new[:, None]

    def attention_mask(self, n_keys: int) -> torch.Tensor:  # (B, 1, T, S)
        keys = torch.arange(n_keys, device=self.start.device)[None, None, :]
        return (keys <= self.positions[:, :, None])[:, None]


def place_blocks(model, plan, device: torch.device) -> list[int]:
    """Move every block whose attention weights the plan homes on the device; returns their indices."""
    moved = []
    for i, block in enumerate(getattr(model, "blocks", [])):
        if plan.homes.get(f"blk.{i}.attn_q.weight", plan.homes.get(f"blk.{i}.attn_norm.weight")) != "gpu":
            continue
        move_tensors(block, device, skip=_experts_of(block))
        block.register_forward_pre_hook(_inputs_to(device))
        block.register_forward_hook(_output_to_host)
        moved.append(i)
    return moved


def _experts_of(block) -> set[int]:
    from strata.models.layers import Experts

    return {id(m) for m in block.modules() if isinstance(m, Experts)}


def move_tensors(module: nn.Module, device: torch.device, skip: set[int] = frozenset()) -> None:
    """Parameters, plain tensor attributes and `Linear`/`Embedding` weights (the engine keeps
    weights as all three) of every submodule."""
    for m in module.modules():
        if id(m) in skip:
            continue
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(m, name, value.to(device))
            elif isinstance(value, (Linear, Embedding)):  # a quantized weight moves as its blocks
                value.to_device(device)
        for name, p in list(m.named_parameters(recurse=False)):
            setattr(m, name, nn.Parameter(p.data.to(device), requires_grad=False))


def _inputs_to(device: torch.device):
    def hook(module, args):
        x, cache, step, rope_cs, *rest = args
        step = DeviceStep(step.start.to(device), step.n_new.to(device), step.width)
        return (x.to(device), cache, step, tuple(t.to(device) for t in rope_cs), *rest)
    return hook


def _output_to_host(module, args, output):
    return output.to("cpu")
