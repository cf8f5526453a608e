"""Prompt-sized products by quantized weights (prefill.c): each weight dequantized once per call
into bfloat16 tiles and multiplied by all rows of x on AMX, float32 accumulation; on a CPU with
AVX2 + FMA but no AMX (`backend()` "avx2", prefill_avx2.h) into float32 tiles for an exact float32
FMA product (`terms` ignored; Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ2_XXS, IQ2_XS,
IQ4_NL and IQ4_XS only, no ggml fallback).

`matmul(x, w)` is `x @ w.T` for a 2-D CPU QTensor w; None where it does not apply (no AMX, no
dequantizer for the type, a row length that is not a multiple of 32). `terms` 3 (the default) keeps
about float32 accuracy (x and W each split into two bfloat16 parts); 1 is one bfloat16 product.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
IQ4_NL, IQ4_XS and MXFP4 have their own AVX-512 decoders, which write each weight's bfloat16 parts
straight into the tiles; other types use ggml's to_float row by row when ggml is loaded, then a
split. `swiglu` and `moe` are one expert / a layer's routed experts over a prompt in one C call.
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.formats.weights import QTensor
from strata.kernels import _build

_ready: bool | None = None


def _lib() -> ctypes.CDLL | None:
    """The kernel library with prefill.c declared, or None without AMX."""
    global _ready
    lib = _build.load()
    if lib is None:
        return None
    if _ready is None and not hasattr(lib, "strata_pp_available"):  # a library built without prefill.c
        _ready = False
    if _ready is None:
        p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.strata_pp_available.restype = c_int
        lib.strata_pp_has_type.argtypes = [c_int, c_int]
        lib.strata_pp_has_type.restype = c_int
        lib.strata_pp_matmul.argtypes = [c_int, p, i64, i64, i64, p, i64, p, c_int, c_int]
        lib.strata_pp_matmul.restype = c_int
        lib.strata_pp_dequant_row.argtypes = [c_int, p, i64, p]
        lib.strata_pp_dequant_row.restype = c_int
        lib.strata_pp_decode_bf16.argtypes = [c_int, p, i64, p, p]
        lib.strata_pp_decode_bf16.restype = c_int
        lib.strata_pp_swiglu.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i64, p, c_int, c_int]
        lib.strata_pp_swiglu.restype = c_int
        lib.strata_pp_moe.argtypes = [p, p, p, p, p, p, p, p, c_int, p, p, p, i64, i64, p, c_int, c_int]
        lib.strata_pp_moe.restype = c_int
        lib.strata_pp_backend.restype = c_int
        _ready = bool(lib.strata_pp_available())
    return lib if _ready else None


def available() -> bool:
    """True when the prompt products can run here (AMX, or the AVX2 + FMA float32 backend)."""
    return _lib() is not None


BACKENDS = {1: "amx", 2: "avx2"}


_backend: list = []  # the library's answer, asked once: every prompt product's routing reads it


def backend() -> str | None:
    """Which prompt products run here: "amx" (bfloat16 tiles, `terms`), "avx2" (float32 FMA, exact:
    `terms` ignored, own decoders only), or None."""
    if not _backend:
        lib = _lib()
        _backend.append(None if lib is None else BACKENDS.get(int(lib.strata_pp_backend())))
    return _backend[0]


_has_type: dict[tuple, bool] = {}  # (qtype, own_only) -> the library's answer, asked once


def has_type(qtype, own_only: bool = False) -> bool:
    """Whether `qtype` has a dequantizer here (`own_only`: this file's own, not ggml's)."""
    hit = _has_type.get((qtype, own_only))
    if hit is None:
        lib = _lib()
        hit = _has_type[qtype, own_only] = lib is not None and bool(lib.strata_pp_has_type(int(qtype), int(own_only)))
    return hit


def matmul(x: torch.Tensor, w: QTensor, threads: int | None = None, terms: int = 3) -> torch.Tensor | None:
    """`x @ w.T` (float32 out, x's leading shape) for CPU tensors, or None where it does not apply."""
    lib = _lib()
    if lib is None or len(w.shape) != 2 or w.raw.device.type != "cpu" or x.device.type != "cpu":
        return None
    rows, cols = w.shape
    qk, ts = GGML_QUANT_SIZES[GGMLQuantizationType(int(w.qtype))]
    if cols % 32 or cols % qk or x.shape[-1] != cols:
        return None
    raw = _build.raw_bytes(w)
    if raw.numel() != rows * (cols // qk) * ts:
        return None
    xf = x.reshape(-1, cols)
    xf = xf if xf.dtype is torch.float32 and xf.is_contiguous() else xf.to(torch.float32).contiguous()
    out = torch.empty(xf.shape[0], rows, dtype=torch.float32)
    if not xf.shape[0]:
        return out.reshape(*x.shape[:-1], rows)
    nth = _build.pool_threads(threads)
    if not lib.strata_pp_matmul(int(w.qtype), raw.data_ptr(), rows, cols, (cols // qk) * ts, xf.data_ptr(),
                                xf.shape[0], out.data_ptr(), terms, nth):
        return None
    return out.reshape(*x.shape[:-1], rows)


def _row_bytes(w: QTensor) -> int:
    qk, ts = GGML_QUANT_SIZES[GGMLQuantizationType(int(w.qtype))]
    return (w.shape[-1] // qk) * ts


def _expert_spec(gate: QTensor, up: QTensor, down: QTensor, small, min_rows):
    """The per-matrix arguments of strata_pp_swiglu / strata_pp_moe, or None if a shape does not fit."""
    ffn, hidden = gate.shape[-2:]
    if tuple(up.shape[-2:]) != (ffn, hidden) or tuple(down.shape[-2:]) != (hidden, ffn) or hidden % 32 or ffn % 32:
        return None
    for q in (gate, up, down):
        qk = GGML_QUANT_SIZES[GGMLQuantizationType(int(q.qtype))][0]
        if q.shape[-1] % qk or q.raw.device.type != "cpu":
            return None
    types = (ctypes.c_int * 3)(*(int(q.qtype) for q in (gate, up, down)))
    wrow = (ctypes.c_int64 * 3)(*(_row_bytes(q) for q in (gate, up, down)))
    fns = (ctypes.c_void_p * 3)(*small) if small is not None else None
    mins = (ctypes.c_int * 3)(*min_rows) if min_rows is not None else None
    return types, wrow, fns, mins, hidden, ffn


def swiglu(x: torch.Tensor, gate: QTensor, up: QTensor, down: QTensor, threads: int | None = None, terms: int = 3,
           small=None, min_rows=None) -> torch.Tensor | None:
    """One expert, down(silu(gate x) * up x), in one C call: x (n, hidden) -> float32 (n, hidden); None
    where it does not apply. `small` (3 qmm.c kernel pointers or None) with `min_rows` (3 ints): a
    matrix multiplied by fewer rows takes its decode kernel."""
    lib = _lib()
    spec = _expert_spec(gate, up, down, small, min_rows) if lib is not None and x.device.type == "cpu" else None
    if spec is None or x.dim() != 2 or x.shape[1] != spec[4] or not x.shape[0]:
        return None
    types, wrow, fns, mins, hidden, ffn = spec
    xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], hidden, dtype=torch.float32)
    nth = _build.pool_threads(threads)
    raws = [_build.raw_bytes(q) for q in (gate, up, down)]
    if not lib.strata_pp_swiglu(types, wrow, fns, mins, *(r.data_ptr() for r in raws), xf.data_ptr(), x.shape[0],
                                hidden, ffn, out.data_ptr(), terms, nth):
        return None
    return out


def moe(x: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, token: torch.Tensor, weight: torch.Tensor,
        stacked: tuple[QTensor, QTensor, QTensor], threads: int | None = None, terms: int = 3,
        small=None, min_rows=None) -> torch.Tensor | None:
    """A layer's routed experts over a prompt in one C call: the used experts `expert` (ids into the
    stacked `[E, out, in]` gate, up, down), each taking `counts` consecutive (token, weight) pairs;
    returns sum over pairs of weight * expert(x[token]) at its token's row (float32, x's shape), or
    None where it does not apply or memory ran out (also part way: that sum is dropped, so the
    caller's other path computes the whole of it)."""
    lib = _lib()
    gate, up, down = stacked
    spec = _expert_spec(gate, up, down, small, min_rows) if lib is not None and x.device.type == "cpu" else None
    if (spec is None or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2
            or x.shape[-1] != spec[4] or any(len(q.shape) != 3 for q in stacked)):
        return None
    types, wrow, fns, mins, hidden, ffn = spec
    raws = [_build.raw_bytes(q) for q in stacked]
    ids = expert.tolist()
    ptrs = [(ctypes.c_void_p * len(ids))(*(r.data_ptr() + e * r.stride(0) for e in ids)) for r in raws]
    counts = counts.to(torch.int64).contiguous()
    token = token.to(torch.int64).contiguous()
    weight = weight.to(torch.float32).contiguous()
    nth = _build.pool_threads(threads)
    out = torch.zeros_like(x)
    rc = lib.strata_pp_moe(types, wrow, fns, mins, *ptrs, counts.data_ptr(), len(ids), token.data_ptr(),
                           weight.data_ptr(), x.data_ptr(), hidden, ffn, out.data_ptr(), terms, nth)
    return out if rc == 1 else None  # rc -1: out holds part of the sum


def dequant_row(w: torch.Tensor, qtype, n: int) -> torch.Tensor | None:
    """One row of `n` values decoded by this file's own dequantizer (for tests), or None."""
    lib = _lib()
    if lib is None:
        return None
    raw = w.contiguous().view(torch.uint8)
    out = torch.empty(n, dtype=torch.float32)
    return out if lib.strata_pp_dequant_row(int(qtype), raw.data_ptr(), n, out.data_ptr()) else None


def decode_bf16(w: torch.Tensor, qtype, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One row of `n` values as the prompt products decode it, straight into bfloat16 (hi, lo)
    parts (for tests), or None without this file's decoder for the type."""
    lib = _lib()
    if lib is None:
        return None
    raw = w.contiguous().view(torch.uint8)
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    ok = lib.strata_pp_decode_bf16(int(qtype), raw.data_ptr(), n, hi.data_ptr(), lo.data_ptr())
    return (hi, lo) if ok else None
