"""One decode step of the gated delta rule in place on its state, by qmm.c's `strata_gdn_step`.

A decode token of a Gated DeltaNet layer touches its whole state (heads x d_k x d_v float32,
3 MiB a layer on Qwen3-Next-size models): torch's form (scaled copy, two batched products, a
rank-1 update) passes over it five times and allocates a new one, which the kernel maps and
zeroes page by page. The C step passes twice, each head's 64 KiB staying in L2 between the two,
and writes the state in place.

`try_gdn_step` returns None where it does not apply (kernels off or not built, not the CPU, not
float32 contiguous), and the caller keeps the torch form.
"""

from __future__ import annotations

import ctypes

import torch

from strata import kernels
from strata.kernels import _build

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P,) * 7 + (_I64,) * 3 + (ctypes.c_int,)


def _kernel():
    return _build.entry("strata_gdn_step", _ARGTYPES)


def _ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype is torch.float32 and t.is_contiguous()


def try_gdn_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """state (N, d_k, d_v) updated in place by one token (q, k (N, d_k); v (N, d_v); decay =
    exp(g) and beta (N,)); returns out (N, d_v), or None (state untouched: see the module doc)."""
    if not kernels.USE_KERNELS:
        return None
    fn = _kernel()
    if fn is None:
        return None
    n, dk, dv = state.shape
    q, k, v, decay, beta = (t.contiguous() for t in (q, k, v, decay, beta))
    if not all(_ok(t) for t in (state, q, k, v, decay, beta)):
        return None
    if q.shape != (n, dk) or k.shape != (n, dk) or v.shape != (n, dv) or decay.numel() != n or beta.numel() != n:
        return None
    out = torch.empty(n, dv)
    fn(state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(),
       out.data_ptr(), n, dk, dv, _build.pool_threads(None))
    return out
