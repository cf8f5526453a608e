"""The small operations of a decode step in one C call each (qmm.c): the rotary embedding, and a
projection group (q/k/v, gate/up) multiplied by its quantized weights in one trip.

On a decode token a layer was ~180 torch operators at 3-5 us each, more time than the kernels on
a small model (bench/decode_profile.py). torch.compile of a norm + rope segment measured 54 us per
call against 86 us eager (its wrapper's own cost), after 61 s of compiling; these calls take a few
microseconds. (An RMS norm in C was left out: its sum of squares cannot follow torch's summation
order, and qwen3-next's recurrence amplified that rounding past its transformers bound.) Each `try_*` returns None when it does not apply (not float32
on the CPU, more than DECODE_MAX values, kernels unavailable or off), and the caller runs torch.
"""

from __future__ import annotations

import ctypes

import torch

from strata import kernels
from strata.formats.weights import QTensor
from strata.kernels import _build

# Above this many values torch's own (threaded, vectorised) operators win: prompts.
DECODE_MAX = 1 << 16


def _ok(x: torch.Tensor) -> bool:
    return (kernels.USE_KERNELS and x.dtype is torch.float32 and x.device.type == "cpu"
            and x.numel() <= DECODE_MAX and x.is_contiguous())


def try_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor | None:
    """x (B, T, H, D) rotated on its first `rot` values by cos/sin (B, T, 1, rot/2), or None."""
    lib = _build.load()
    if lib is None or not _ok(x) or x.dim() != 4 or cos.dtype is not torch.float32:
        return None
    b, t, h, d = x.shape
    if cos.shape != (b, t, 1, rot // 2) or sin.shape != cos.shape or rot > d:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    lib.strata_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), b * t, h, d, rot, int(interleaved), out.data_ptr())
    return out


def try_qmatmul_group(x: torch.Tensor, weights: tuple[QTensor, ...],
                      biases: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor] | None:
    """[x @ W_j.T + bias_j] for a group of weights sharing x, in one C call, or None (a weight
    without an own kernel, a ggml-only type, not a decode-sized float32 x on the CPU)."""
    lib = _build.load()
    if lib is None or not _ok(x):
        return None
    cols = x.shape[-1]
    rows_x = x.numel() // cols if cols else 0
    if not 0 < rows_x <= kernels.FAST_BATCH_MAX:
        return None
    plans = [kernels._plan(w) for w in weights]
    if any(p is None or p.fnptr is None or p.cols != cols for p in plans):
        return None
    for bias, p in zip(biases, plans):
        if bias is not None and (bias.dtype is not torch.float32 or bias.numel() != p.rows or not bias.is_contiguous()):
            return None
    n = len(plans)
    rows = [p.rows for p in plans]
    out = torch.empty(*x.shape[:-1], sum(rows))
    scratch = torch.empty(rows_x * max(rows)) if rows_x > 1 else out
    lib.strata_qmm_group(n, (ctypes.c_void_p * n)(*(p.fnptr for p in plans)), (ctypes.c_void_p * n)(*(p.ptr for p in plans)),
                         (ctypes.c_int64 * n)(*rows), cols, x.data_ptr(), rows_x,
                         (ctypes.c_void_p * n)(*(0 if bi is None else bi.data_ptr() for bi in biases)),
                         out.data_ptr(), scratch.data_ptr(), torch.get_num_threads())
    parts = out.split(rows, dim=-1)
    return list(parts) if rows_x == 1 else [t.contiguous() for t in parts]
