"""x W^T for a float16 weight kept as stored, by qmm.c's `strata_f16mm` (one C call).

torch's CPU float16 `F.linear` costs 12-30 us a call for one row and 45-115 us for 2-4 rows on
this machine (small matrices: a oneDNN primitive per shape, x rounded to float16 and the result
too), so a speculative verify pass of k+1 positions paid several times a decode step for its
dense products. `strata_f16mm` widens each weight to float32 as it reads it (F16C) and multiplies
by x in float32 (never rounded), the same few microseconds of call whatever the batch; each row's
result does not depend on the other rows, so a verify pass's first position computes exactly
what a one-token decode step does. (ggml's own `vec_dot_f16` was not used: built for a CPU with
AVX512-FP16 it sums in float16, 4x further from exact than torch here.)

`try_f16_matmul` returns None where it does not apply (kernels off or not built, not the CPU,
more than `kernels.FAST_BATCH_MAX` rows: a prompt, where torch's GEMM wins), and the caller keeps
torch's product.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from strata import kernels
from strata.kernels import _build, plan_cache
from strata.kernels.decode_ops import _vec


class _Plan(NamedTuple):
    ptr: int
    rows: int
    cols: int


_plans = plan_cache.PlanCache()  # w -> its _Plan (None: not a contiguous 2-D CPU float16 matrix)
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I64, _I64, _P, _I64, _P, ctypes.c_int)


def _make_plan(w: torch.Tensor) -> _Plan | None:
    ok = w.dim() == 2 and w.dtype is torch.float16 and w.device.type == "cpu" and w.is_contiguous()
    return _Plan(w.data_ptr(), w.shape[0], w.shape[1]) if ok else None


def _plan(w: torch.Tensor) -> _Plan | None:
    return _plans.get(w, None, _make_plan, w)


def _kernel():
    """The library's strata_f16mm (None: no library)."""
    return _build.entry("strata_f16mm", _ARGTYPES)


def try_f16_matmul(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor | None:
    """x (..., in) @ w.T for a float16 w (out, in), in x's dtype, or None (see the module doc)."""
    if not kernels.USE_KERNELS or x.device.type != "cpu":
        return None
    fn = _kernel()
    p = _plan(w) if fn is not None else None
    if p is None:
        return None
    cols = x.shape[-1]
    b = x.numel() // cols if cols else 0
    if cols != p.cols or not 0 < b <= kernels.FAST_BATCH_MAX:
        return None
    xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    out = torch.empty(*x.shape[:-1], p.rows)
    fn(p.ptr, p.rows, p.cols, xf.data_ptr(), b, out.data_ptr(), _build.pool_threads(threads))
    return out if x.dtype is torch.float32 else out.to(x.dtype)


_HC_ARGTYPES = (_P, _I64, _I64, _I64, _P, ctypes.c_float, _P, _P, _P, _I64, _P, _P, ctypes.c_int)


def try_hc_mix(x: torch.Tensor, norm: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
               inject: torch.Tensor | None, hc: int, hidden: int, eps: float,
               threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A hyper-connection mix (`HyperConnection.mix`) of float32 x (..., hc*hidden) with float16
    down / up / inject matrices, by hc_mix.c's `strata_hc_mix` (one call; the torch form ran ~15
    operators around its three products): (mixed (..., hidden), weights (..., hc) or None), or
    None where it does not apply (as `try_f16_matmul`, or norm not a float32 vector)."""
    if not kernels.USE_KERNELS or x.device.type != "cpu" or x.dtype is not torch.float32:
        return None
    fn = _build.entry("strata_hc_mix", _HC_ARGTYPES, ctypes.c_int)
    if fn is None:
        return None
    width = hc * hidden
    pd, pu = _plan(down), _plan(up)
    pi = _plan(inject) if inject is not None else None
    if pd is None or pu is None or (inject is not None and pi is None):
        return None
    rank = pd.rows
    if (x.shape[-1] != width or pd.cols != width or (pu.rows, pu.cols) != (width, rank)
            or (pi is not None and (pi.rows, pi.cols) != (hc, width)) or not _vec(norm) or norm.numel() != width):
        return None
    b = x.numel() // width
    if not 0 < b <= kernels.FAST_BATCH_MAX:
        return None
    xc = x.contiguous()
    mixed = torch.empty(*x.shape[:-1], hidden)
    weights = torch.empty(*x.shape[:-1], hc) if inject is not None else None
    if not fn(xc.data_ptr(), b, hc, hidden, norm.data_ptr(), eps, pd.ptr, pu.ptr, 0 if pi is None else pi.ptr, rank,
              mixed.data_ptr(), 0 if weights is None else weights.data_ptr(), _build.pool_threads(threads)):
        return None
    return mixed, weights
