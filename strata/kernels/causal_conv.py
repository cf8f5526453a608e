"""A Gated DeltaNet layer's causal depthwise conv by causal_conv.c's `strata_causal_conv`.

torch's tap-by-tap form passes over a prompt's (T, C) output once per tap (Qwen3-Next: 4 taps of
16 MiB for 512 tokens); the C form sums each output row over the taps while it sits in cache,
with the same operations in the same order (first tap's product, then a fused multiply-add per
tap). `try_causal_conv` returns None where it does not apply (kernels off or not built, not the
CPU, not float32), and the caller keeps the torch form.
"""

from __future__ import annotations

import ctypes

import torch

from strata import kernels
from strata.kernels import _build

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P,) * 3 + (_I64,) * 4 + (ctypes.c_int,)


def _kernel():
    return _build.entry("strata_causal_conv", _ARGTYPES)


def try_causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """window (B, K-1+T, C): the conv state then the new inputs; weight (C, K). Returns the conv's
    output (B, T, C) (no activation), or None (see the module doc)."""
    if not kernels.USE_KERNELS or window.device.type != "cpu" or window.dtype is not torch.float32 \
            or weight.dtype is not torch.float32 or window.dim() != 3:
        return None
    fn = _kernel()
    if fn is None:
        return None
    b, rows, c = window.shape
    k = weight.shape[1]
    if weight.shape[0] != c or rows < k:
        return None
    window = window.contiguous()
    taps = weight.t().contiguous()  # (K, C): one tap's weights along the channels
    t = rows - (k - 1)
    out = torch.empty(b, t, c)
    fn(window.data_ptr(), taps.data_ptr(), out.data_ptr(), b, t, c, k, _build.pool_threads(None))
    return out
