"""The reference grouped expert product, which the CPU kernels and the Triton kernels match.

(x, ids, weights) -> y: each token's routed experts' SwiGLU outputs, weighted and summed; each
used expert runs once over all its tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run_experts(x, ids, weights, fetch, experts=None) -> torch.Tensor:
    """Reference grouped expert product: for each used expert, its tokens in one matmul."""
    out = torch.zeros_like(x)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)
    token_of = order // ids.shape[1]
    start = 0
    for e, n in zip(used.tolist(), counts.tolist()):
        if experts is not None and e not in experts:
            start += n
            continue
        sel = order[start:start + n]
        tok = token_of[start:start + n]
        start += n
        gate, up, down = fetch(e)
        xs = x[tok]
        y = F.linear(F.silu(F.linear(xs, gate)) * F.linear(xs, up), down)
        out.index_add_(0, tok, y * weights.reshape(-1)[sel, None])
    return out
