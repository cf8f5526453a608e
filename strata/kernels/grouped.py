"""The grouped expert product, the one primitive every MoE layer calls: (x, a route table) -> y.

A route table lists a layer's (token, expert, weight) pairs: row `token` of x goes through SwiGLU
expert `expert` (an expert id, or a device-cache slot: whatever the weights argument indexes) and is
added to y[token] times `weight`. Routers and tiers only fill the table (`route_table`); the
reference here, the CPU kernels (`strata.kernels.grouped_swiglu`) and the Triton kernels
(`strata.kernels.gpu.grouped_swiglu`) each compute it, and `strata.kernels.moe` picks one, as
mlx-lm's SwitchGLU hands (x, indices) to gather_qmm.

The weights argument is either `experts(e) -> (gate, up, down)` QTensors of expert (or slot) e, or
the three stacked `[E, out, in]` QTensors themselves (a device-resident layer: nothing read back).
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Union

import torch
import torch.nn.functional as F

from strata.formats.weights import QTensor

ExpertSource = Union[Callable[[int], tuple[QTensor, QTensor, QTensor]], tuple[QTensor, QTensor, QTensor]]


class RouteTable(NamedTuple):
    """(token, expert or slot, weight) pairs, grouped by expert: sorted by expert (tokens in order
    within one), or one token's distinct experts in the router's order."""

    token: torch.Tensor  # (P,) int64: the row of x
    expert: torch.Tensor  # (P,) int64: what the weights argument indexes (expert id or cache slot)
    weight: torch.Tensor  # (P,): the router's weight of the pair

    def to(self, device: torch.device) -> "RouteTable":
        return RouteTable(*(t.to(device) for t in self))


def route_table(ids: torch.Tensor, weights: torch.Tensor, keep=None) -> RouteTable:
    """The table of a router's top-k: ids, weights (N, k). `keep` (a set of experts): only their
    pairs (the rest are computed elsewhere). Sorting runs where ids live: a device table reads
    nothing back."""
    flat = ids.reshape(-1)
    if ids.shape[0] == 1 and keep is None:  # one token (decode): its k experts are distinct, no sort needed
        return RouteTable(torch.zeros_like(flat, dtype=torch.int64), flat.to(torch.int64), weights.reshape(-1))
    index = torch.argsort(flat, stable=True)
    if keep is not None:
        kept = torch.tensor(sorted(keep), dtype=flat.dtype, device=flat.device)
        index = index[torch.isin(flat[index], kept)]
    return RouteTable(index // ids.shape[-1], flat[index].to(torch.int64), weights.reshape(-1)[index])


def expert_groups(table: RouteTable) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The grouping loop, written once: each used expert with its tokens and weights (one read back)."""
    used, counts = torch.unique_consecutive(table.expert, return_counts=True)
    start = 0
    for e, n in zip(used.tolist(), counts.tolist()):
        yield e, table.token[start:start + n], table.weight[start:start + n]
        start += n


def as_source(experts: ExpertSource) -> Callable[[int], tuple[QTensor, QTensor, QTensor]]:
    """`experts` as a function of the expert (or slot) index."""
    if callable(experts):
        return experts
    gate, up, down = experts
    return lambda e: (gate[e], up[e], down[e])


def swiglu_reference(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """One expert, down(silu(gate x) * up x): dequantize (QTensors; float tensors are used as they
    are), then matmul, in x's dtype."""
    g, u, d = (q if isinstance(q, torch.Tensor) else q.dequantize(x.dtype) for q in (gate, up, down))
    return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)


def grouped_swiglu(x: torch.Tensor, table: RouteTable, experts: ExpertSource,
                   forward: Callable[..., torch.Tensor] = swiglu_reference) -> torch.Tensor:
    """y (N, hidden) in x's dtype: each used expert once over all its tokens, by `forward(xs, gate,
    up, down)` (the reference by default; the CPU kernels pass theirs), weighted and summed."""
    source = as_source(experts)
    out = torch.zeros_like(x)
    for e, tok, w in expert_groups(table):
        out.index_add_(0, tok, forward(x[tok], *source(e)) * w[:, None])
    return out


def run_experts(x, ids, weights, experts: ExpertSource, keep=None) -> torch.Tensor:
    """The reference over a router's (ids, weights): fill the table, then `grouped_swiglu`."""
    return grouped_swiglu(x, route_table(ids, weights, keep), experts)
