"""Device kernels for quantized experts: Triton, multiplying straight from ggml blocks.

`qmatmul(x, w)` is `x @ w.T` for a `QTensor` w; `grouped_swiglu(x, table, experts)` is the grouped
expert product (`strata.kernels.grouped`) of a layer's (token, expert or slot, weight) pairs over
weights already on the device (cache slots, or experts pinned there). Each picks Triton when
the tensors are on CUDA, or when TRITON_INTERPRET=1 asks for Triton's interpreter (how the
tests run the kernels on CPU tensors), and the type has a decoder. `qmatmul` takes a tiled kernel
for prefill batches (decoded tiles into `tl.dot`, W read once per 32 rows); the grouped expert
product takes Triton only for small batches, else the plain torch reference beside it
(dequantize, then matmul).

Triton is imported only when a kernel first runs, so CPU-only use never loads it.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from gguf import GGMLQuantizationType as T

from strata.formats.weights import QTensor
from strata.kernels import qmatmul_reference
from strata.kernels import grouped
from strata.kernels.grouped import ExpertSource, RouteTable

__all__ = [
    "KERNEL_TYPES",
    "MAX_ROWS",
    "USE_TRITON",
    "applies",
    "available",
    "grouped_swiglu",
    "has_kernel",
    "on_triton",
    "qmatmul",
    "qmatmul_reference",
    "qmatmul_triton",
]

KERNEL_TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
                T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS)

# Tokens per call above which the reference (dequantize + cuBLAS) is used instead: each token
# re-reads the weights from L2, while a dense matmul reuses them from registers.
MAX_ROWS = 64

# Switch for comparisons (benchmarks): False sends every call down the torch reference path.
USE_TRITON = True


@functools.cache
def available() -> bool:
    """True when Triton imports (it ships with CUDA builds of torch; `pip install strata[gpu]`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def has_kernel(qtype) -> bool:
    return int(qtype) in {int(t) for t in KERNEL_TYPES}


def on_triton(x: torch.Tensor, *qtypes) -> bool:
    """Whether Triton serves activations x (CUDA, or the interpreter) and weights of these types."""
    return USE_TRITON and (x.is_cuda or interpreted()) and all(map(has_kernel, qtypes)) and available()


def applies(x: torch.Tensor, *qtypes) -> bool:
    """Whether the decode-sized Triton kernels (one row of x per program) run for x."""
    return x.numel() // max(x.shape[-1], 1) <= MAX_ROWS and on_triton(x, *qtypes)


def _kernels():
    from strata.kernels.gpu import kernels  # imports triton

    return kernels


def qmatmul_triton(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """`x @ w.T` in float32 by the Triton kernel; w (out, in) must be on x's device."""
    if len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x (..., {x.shape[-1]}) cannot multiply a weight of shape {w.shape}")
    out = _kernels().qmatmul(x.reshape(-1, x.shape[-1]), w.raw, w.qtype, w.shape)
    return out.reshape(*x.shape[:-1], w.shape[0])


def qmatmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """`x @ w.T` in x's dtype from w's blocks: on Triton the decode kernel for a few rows, the tiled
    one (`tl.dot` over decoded tiles) for a prefill batch, so nothing is dequantized per call;
    elsewhere the reference."""
    if not on_triton(x, w.qtype):
        return qmatmul_reference(x, w)
    if x.numel() // max(x.shape[-1], 1) <= MAX_ROWS:
        return qmatmul_triton(x, w).to(x.dtype)
    if len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x (..., {x.shape[-1]}) cannot multiply a weight of shape {w.shape}")
    out = _kernels().qmatmul_batched(x.reshape(-1, x.shape[-1]), w.raw, w.qtype, w.shape)
    return out.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


def _byte_sources(views: list[tuple[torch.Tensor, ...]]):
    """(per projection a uint8 tensor over the one allocation all experts' bytes share,
    CPU int64 (experts, projections) byte offsets into them), or None when some projection's
    bytes are spread over several allocations (the caller then takes the reference path)."""
    bases, offsets = [], []
    for i in range(len(views[0])):
        storage = views[0][i].untyped_storage()
        if any(v[i].untyped_storage().data_ptr() != storage.data_ptr() or not v[i].is_contiguous() for v in views):
            return None
        bases.append(torch.empty(0, dtype=torch.uint8, device=views[0][i].device).set_(storage))
        offsets.append([v[i].data_ptr() - storage.data_ptr() for v in views])
    return bases, torch.tensor(offsets, dtype=torch.int64).T


def grouped_swiglu(x: torch.Tensor, table: RouteTable, experts: ExpertSource) -> torch.Tensor:
    """The grouped expert product (`strata.kernels.grouped`) by Triton: every pair of `table` in one
    launch per projection, summed per token in float32, returned in x's dtype.

    `experts` a function (expert or slot -> its QTensors on x's device): the table is on the host
    (the tiers' copy, no second read), byte offsets are worked out there and copied over once.
    `experts` the stacked QTensors: the table is on x's device and so are the offsets (nothing read
    back). The reference runs where Triton does not apply or an expert's bytes are spread.
    """
    if callable(experts):
        if not table.token.numel():
            return torch.zeros_like(x)
        used, which = torch.unique_consecutive(table.expert, return_inverse=True)
        views = [experts(e) for e in used.tolist()]
        parts = views[0]
        sources = _byte_sources([tuple(q.raw for q in v) for v in views]) if applies(x, *(q.qtype for q in parts)) else None
        if sources is None:
            return grouped.grouped_swiglu(x, table.to(x.device), experts)
        bases, offsets = sources
        align = [functools.reduce(math.gcd, offsets[:, i].tolist(), 0) for i in range(3)]  # for the word size
        # (4, P): token, gate / up / down byte offsets; one copy, and one of the weights
        meta = torch.cat([table.token[:, None], offsets[which]], dim=1).T.contiguous()
        meta, scale = ((t.pin_memory() if x.is_cuda else t).to(x.device, non_blocking=True)  # no stream sync
                       for t in (meta, table.weight.to(torch.float32)))
        tok, sources = meta[0], list(zip(bases, meta[1:]))
    else:
        parts = tuple(q[0] for q in experts)
        if not applies(x, *(q.qtype for q in parts)):
            return grouped.grouped_swiglu(x, table, experts)
        tok, scale = table.token, table.weight
        sources = [(q.raw.reshape(-1), table.expert * q.raw[0].numel()) for q in experts]
        align = [q.raw[0].numel() for q in experts]  # offsets are multiples of one expert's bytes
    y = _kernels().grouped_swiglu(x, tok, scale, sources, parts, offset_align=align)  # (P, hidden)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, y)
    return out.to(x.dtype)
