"""Which implementation computes a grouped expert product (`strata.kernels.grouped`): Triton on the
device (or under its interpreter when the caller is the device half), the CPU kernels when every
projection's type has one, else the reference."""

from __future__ import annotations

import torch

from strata import kernels
from strata.kernels import gpu
from strata.kernels.grouped import ExpertSource, RouteTable, as_source, grouped_swiglu as reference


def grouped_swiglu(x: torch.Tensor, table: RouteTable, experts: ExpertSource, device_half: bool = False,
                   threads: int | None = None) -> torch.Tensor:
    """y = the grouped product of `table` over `experts`. `device_half`: the caller is the tiers'
    device half, which takes Triton under TRITON_INTERPRET=1 on CPU tensors too (how tests run it).
    `threads`: the CPU kernels' threads (None: torch's count)."""
    if x.is_cuda:
        return gpu.grouped_swiglu(x, table, experts)
    if not table.expert.numel():
        return torch.zeros_like(x)
    first = experts if not callable(experts) else as_source(experts)(int(table.expert[0]))  # the types
    if device_half and gpu.applies(x, *(q.qtype for q in first)):
        return gpu.grouped_swiglu(x, table, experts)
    if kernels.experts_fast_ok(x, *first):
        return kernels.grouped_swiglu(x, table, experts, threads)
    return reference(x, table, experts)
