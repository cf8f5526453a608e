"""Device kernels for quantized experts: Triton, multiplying straight from ggml blocks.

`qmatmul(x, w)` is `x @ w.T` for a `QTensor` w; `expert_product(...)` is the grouped SwiGLU
product of a layer's (token, expert) pairs over weights already on the device (cache slots,
or experts pinned there), summed into tokens in the router's weights. Each picks Triton when
the tensors are on CUDA, or when TRITON_INTERPRET=1 asks for Triton's interpreter (how the
tests run the kernels on CPU tensors), the type has a decoder and the batch is small; else it
takes the plain torch reference beside it (dequantize, then matmul), which wins for large
batches (prefill) where cuBLAS on dequantized weights beats re-decoding blocks per token.

Triton is imported only when a kernel first runs, so CPU-only use never loads it.
"""

from __future__ import annotations

import functools
import os

import torch
from gguf import GGMLQuantizationType as T

from strata.formats.weights import QTensor
from strata.kernels import qmatmul_reference
from strata.kernels.grouped import run_experts

__all__ = [
    "KERNEL_TYPES",
    "MAX_ROWS",
    "USE_TRITON",
    "applies",
    "available",
    "expert_pairs",
    "expert_product",
    "expert_product_reference",
    "has_kernel",
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


def applies(x: torch.Tensor, *qtypes) -> bool:
    """Whether the Triton path runs for activations x and weights of these types."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (USE_TRITON and (x.is_cuda or interpreted()) and rows <= MAX_ROWS
            and all(map(has_kernel, qtypes)) and available())


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
    """`x @ w.T` in x's dtype: Triton when it applies, else the reference."""
    if applies(x, w.qtype):
        return qmatmul_triton(x, w).to(x.dtype)
    return qmatmul_reference(x, w)


def expert_pairs(ids: torch.Tensor, experts: set[int], ids_host: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, top-k position) pairs routed to `experts`, ordered by expert, as CPU tensors.

    Returns token (P,), the pair's index into ids.reshape(-1) (P,), and its expert (P,); pairs
    of one expert are adjacent, so their programs share the expert's blocks in L2.
    """
    ids_cpu = (ids.cpu() if ids_host is None else ids_host).reshape(-1)  # the host copy: no second read
    flat = torch.isin(ids_cpu, torch.tensor(sorted(experts), dtype=ids_cpu.dtype)).nonzero().reshape(-1)
    order = torch.argsort(ids_cpu[flat], stable=True)
    flat = flat[order]
    return flat // ids.shape[-1], flat, ids_cpu[flat]


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


def expert_product(x, ids, weights, experts: set[int], fmt, parts, ids_host=None) -> torch.Tensor:
    """SwiGLU experts for every (token, expert) pair with expert in `experts`, summed per token.

    x (N, hidden); ids, weights (N, k); fmt the layer's `ExpertFormat`; parts(e) the byte views
    of expert e's (gate, up, down) on x's device. Triton when `applies`, else the reference.
    """
    if not applies(x, *(p.qtype for p in fmt.parts)):
        return expert_product_reference(x, ids, weights, experts, fmt, parts)
    tok, flat, expert = expert_pairs(ids, experts, ids_host)
    used, which = torch.unique_consecutive(expert, return_inverse=True)
    sources = _byte_sources([parts(e) for e in used.tolist()])
    if sources is None:
        return expert_product_reference(x, ids, weights, experts, fmt, parts)
    bases, offsets = sources
    # (5, P): token, index into the router's weights, gate / up / down byte offsets; one copy
    meta = torch.cat([tok[:, None], flat[:, None], offsets[which]], dim=1).T.contiguous()
    meta = (meta.pin_memory() if x.is_cuda else meta).to(x.device, non_blocking=True)  # no stream sync
    scale = weights.reshape(-1)[meta[1]]
    y = _kernels().grouped_swiglu(x, meta[0], scale, list(zip(bases, meta[2:])), fmt.parts)  # (P, hidden)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, meta[0], y)
    return out.to(x.dtype)


def expert_product_reference(x, ids, weights, experts: set[int], fmt, parts) -> torch.Tensor:
    """The plain path: dequantize each expert's bytes, then `run_experts`."""
    return run_experts(x, ids, weights, lambda e: fmt.weights(parts(e), x.dtype), experts)
