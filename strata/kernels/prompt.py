"""Prompt-sized products by quantized weights on AMX (prefill.c): each weight dequantized once per
call into bfloat16 tiles and multiplied by all rows of x, float32 accumulation.

`matmul(x, w)` is `x @ w.T` for a 2-D CPU QTensor w; None where it does not apply (no AMX, no
dequantizer for the type, a row length that is not a multiple of 32). `terms` 3 (the default) keeps
about float32 accuracy (x and W each split into two bfloat16 parts); 1 is one bfloat16 product.
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ2_XXS and IQ2_XS have their own AVX-512 dequantizers; other types
use ggml's to_float row by row when ggml is loaded.
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.formats.weights import QTensor
from strata.kernels import _build

_ready: bool | None = None


def _lib() -> ctypes.CDLL | None:
    """The kernel library with prefill.c declared and its tables set, or None without AMX."""
    global _ready
    lib = _build.load()
    if lib is None:
        return None
    if _ready is None:
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.strata_pp_init_tables.argtypes = [p, p, p]
        lib.strata_pp_init_tables.restype = None
        lib.strata_pp_available.restype = c_int
        lib.strata_pp_has_type.argtypes = [c_int, c_int]
        lib.strata_pp_has_type.restype = c_int
        lib.strata_pp_matmul.argtypes = [c_int, p, i64, i64, i64, p, i64, p, c_int, c_int]
        lib.strata_pp_matmul.restype = c_int
        lib.strata_pp_dequant_row.argtypes = [c_int, p, i64, p]
        lib.strata_pp_dequant_row.restype = c_int
        iq2xxs, iq2xs, _iq3xxs, ksigns = _build._tables
        lib.strata_pp_init_tables(iq2xxs.ctypes.data, iq2xs.ctypes.data, ksigns.ctypes.data)
        _ready = bool(lib.strata_pp_available())
    return lib if _ready else None


def available() -> bool:
    """True when the AMX prompt products can run here."""
    return _lib() is not None


def has_type(qtype, own_only: bool = False) -> bool:
    """Whether `qtype` has a dequantizer here (`own_only`: this file's own, not ggml's)."""
    lib = _lib()
    return lib is not None and bool(lib.strata_pp_has_type(int(qtype), int(own_only)))


def matmul(x: torch.Tensor, w: QTensor, threads: int | None = None, terms: int = 3) -> torch.Tensor | None:
    """`x @ w.T` (float32 out, x's leading shape) for CPU tensors, or None where it does not apply."""
    lib = _lib()
    if lib is None or len(w.shape) != 2 or w.raw.device.type != "cpu" or x.device.type != "cpu":
        return None
    rows, cols = w.shape
    qk, ts = GGML_QUANT_SIZES[GGMLQuantizationType(int(w.qtype))]
    if cols % 32 or cols % qk or x.shape[-1] != cols:
        return None
    raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
    raw = raw if raw.dtype == torch.uint8 else raw.view(torch.uint8)
    if raw.numel() != rows * (cols // qk) * ts:
        return None
    xf = x.reshape(-1, cols)
    xf = xf if xf.dtype is torch.float32 and xf.is_contiguous() else xf.to(torch.float32).contiguous()
    out = torch.empty(xf.shape[0], rows, dtype=torch.float32)
    if not xf.shape[0]:
        return out.reshape(*x.shape[:-1], rows)
    nth = int(threads) if threads and threads > 0 else torch.get_num_threads()
    if not lib.strata_pp_matmul(int(w.qtype), raw.data_ptr(), rows, cols, (cols // qk) * ts, xf.data_ptr(),
                                xf.shape[0], out.data_ptr(), terms, nth):
        return None
    return out.reshape(*x.shape[:-1], rows)


def dequant_row(w: torch.Tensor, qtype, n: int) -> torch.Tensor | None:
    """One row of `n` values decoded by this file's own dequantizer (for tests), or None."""
    lib = _lib()
    if lib is None:
        return None
    raw = w.contiguous().view(torch.uint8)
    out = torch.empty(n, dtype=torch.float32)
    return out if lib.strata_pp_dequant_row(int(qtype), raw.data_ptr(), n, out.data_ptr()) else None
