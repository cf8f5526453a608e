"""The device path's kernels as torch custom ops (`torch.ops.strata.*`), each with a fake implementation.

A fake implementation says what an op returns (shape, dtype, device) without computing it. That
is what lets a decode step run under `FakeTensorMode` on fake CUDA tensors (the test that no step
reads the device back, on a machine without a GPU), and what `torch.compile` and CUDA graphs
need to trace through these calls. The real implementations pick Triton when it applies
(`strata.kernels.gpu.applies`), else a torch path that never reads the device either.

- `attention`: scaled-dot-product attention with a boolean mask.
- `qmatmul`: x W^T for W in ggml blocks.
- `experts`: the SwiGLU product of each token's routed experts, over a layer's stacked experts
  (E, rows, row_bytes), summed in the router's weights; pair metadata is built on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from strata.formats.weights import FLOAT_TYPES, QTensor
from strata.kernels.grouped import route_table


@torch.library.custom_op("strata::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              enable_gqa: bool) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, H_kv, S, D); mask (B, 1, T, S) True = may attend; -> (B, H, T, D_v)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


@attention.register_fake
def _(q, k, v, mask, enable_gqa):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("strata::qmatmul", mutates_args=())
def qmatmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """x (N, in) times W^T for W's blocks raw (out, row_bytes) -> (N, out) in x's dtype."""
    from strata.kernels import gpu

    return gpu.qmatmul(x, QTensor(raw, T(qtype), (raw.shape[0], in_features)))


@qmatmul.register_fake
def _(x, raw, qtype, in_features):
    return x.new_empty(x.shape[0], raw.shape[0])


@torch.library.custom_op("strata::experts", mutates_args=())
def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
            down: torch.Tensor, qtypes: list[int], hidden: int, ffn: int) -> torch.Tensor:
    """x (N, hidden); ids, weights (N, k); gate/up (E, ffn, row_bytes), down (E, hidden, row_bytes)
    stacked experts in their stored types -> (N, hidden) in x's dtype. The route table is built on
    the device; the grouped product is Triton's, gathered float experts, else the reference."""
    from strata.kernels import gpu

    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    stacked = tuple(QTensor(t, T(q), (t.shape[0], *s)) for t, q, s in zip((gate, up, down), qtypes, shapes))
    n, k = ids.shape
    if all(T(q) in FLOAT_TYPES for q in qtypes) and n * k * ffn * hidden <= 1 << 26:
        return _gathered(x, ids, weights, (gate, up, down), stacked)
    return gpu.grouped_swiglu(x, route_table(ids, weights), stacked)


@experts.register_fake
def _(x, ids, weights, gate, up, down, qtypes, hidden, ffn):
    return torch.empty_like(x)


def _gathered(x, ids, weights, raws, stacked) -> torch.Tensor:
    """Float experts for a few tokens: each pair's weights gathered by index, then batched matmuls;
    no step depends on which experts were picked, so nothing is read back."""
    g, u, d = (r.view(FLOAT_TYPES[q.qtype]).reshape(q.shape)[ids.reshape(-1)].to(x.dtype)
               for r, q in zip(raws, stacked))  # (P, out, in)
    xs = x.repeat_interleave(ids.shape[1], dim=0)[:, :, None]  # (P, hidden, 1)
    h = F.silu(torch.bmm(g, xs)) * torch.bmm(u, xs)
    y = torch.bmm(d, h)[:, :, 0] * weights.reshape(-1, 1).to(x.dtype)  # (P, hidden)
    return y.reshape(*ids.shape, -1).sum(1)
