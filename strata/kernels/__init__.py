"""CPU kernels that multiply by quantized weights without dequantizing them first.

`qmatmul(x, w)` computes `x @ w.T` for a `QTensor` w in its stored ggml type. A compiled C
kernel (qmm.c, built with the system C compiler on first use and cached) decodes 8 weights at
a time into a vector register and uses them for up to 8 rows of x, so an expert is read once
per call and never materialised as floats; output rows are shared out over a small thread
pool (`threads`, default _build.pool_threads(None)). `expert_forward` is one SwiGLU expert on
top of it, `grouped_swiglu` the grouped expert product (`strata.kernels.grouped`) of a layer.

Every fast path has its plain torch reference beside it (`*_reference`: dequantize, then
matmul). The fast one is used when the type has a kernel, the tensors are on the CPU and the
batch is at most FAST_BATCH_MAX rows, else the reference runs. Activations (`set_activations`):
- "q8x2" (default): where llama.cpp's CPU library is installed (_ggml.py), x is quantized once
  per product to ggml's 8-bit blocks (q8_0 / q8_1 / q8_K) and ggml's integer dot products run
  on this package's thread pool, twice: over x's 8-bit value and over its 8-bit residual (x
  minus that value), the same weight bytes read once; error ~3e-5 of max |y| (llama.cpp's own
  single pass: ~1e-2). On AVX2 CPUs (AVX-512 VNNI / AVX-VNNI / AVX2 kernel sets, the best chosen
  from cpuid, STRATA_KERNEL_ISA forces one) Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K,
  IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS and MXFP4 take qmm.c's
  one-pass kernels instead
  (each weight block unpacked once for both activations: AVX-512 VNNI 1.2-3.3x, AVX2 1.06-1.9x
  faster than ggml's two passes, `bench_kernels.py --fused-ab`). Prompt-sized batches take prefill.c's AMX products where the
  CPU has AMX-BF16 (`try_qmatmul_prompt`, `strata.kernels.prompt`: x and W each split into two
  bfloat16 parts, float32 accumulation, ~5e-6 of max |y|; a prompt's experts one C call per layer),
  on an AVX2 + FMA CPU without AMX the same calls in exact float32 (own AVX2 decoders, FMA
  micro-kernel; the types of PROMPT_AVX2_MIN_ROWS), else W dequantized by ggml to float32 for one matmul.
  Adds IQ1_S, IQ1_M, IQ2_S and IQ3_S. Without ggml, as "int16".
- "q8c" (`--activations q8c`): the 256-value types (K-quants, IQ types) take one 8-bit pass with a
  step per 32 values (qmm.c's q8c_prep: the chunk's largest |x| sets it, where ggml's q8_K takes the
  block's), from the best 256-bit kernel set on every CPU: llama.cpp's accuracy class (RMS error
  0.54-0.62x of its single pass on x with uneven channels) at ~0.8x "q8x2"'s kernel time (decode
  +18-20 % on the Q4_K_M and IQ2_XS bench files, 1 thread, AVX2 Zen 3). Other types as "q8x2", and
  IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S too where the CPU has AVX-512 VBMI (their "q8x2"
  permute kernels are faster).
- "q8": one pass, as llama.cpp computes (relative error ~1e-2), 10-60 % less kernel time than
  "q8x2" (IQ2 types gain most); prompt batches take one bfloat16 product (AMX).
- "int16": for Q4_K, Q5_K, Q6_K, Q8_0, IQ2_XXS, IQ2_XS, IQ4_NL, IQ4_XS and MXFP4 (AVX2 builds)
  x is quantized to int16 per row (vpmaddwd), relative error ~3e-5; others as "float32".
- "float32" (`--exact-activations`): x stays float32; differs from the reference only in
  summation order.
Without a C compiler, or with STRATA_KERNELS=0, everything takes the reference path.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.formats.weights import QTensor
from strata.kernels import _build, grouped, plan_cache, prompt
from strata.kernels import threads as torch_threads
from strata.kernels.grouped import ExpertSource, RouteTable

__all__ = [
    "FAST_BATCH_MAX",
    "available",
    "expert_forward",
    "expert_forward_reference",
    "fast_ok",
    "grouped_swiglu",
    "has_kernel",
    "kernel_types",
    "qmatmul",
    "qmatmul_fast",
    "qmatmul_reference",
    "run_experts_fast",
    "set_activations",
    "try_qmatmul",
    "try_qmatmul_batched",
    "try_qmatmul_dequantized",
    "dequantize_ggml",
]

# Above this many rows of x, dequantizing once and calling BLAS wins over decoding the blocks
# for every 8 rows (bench/bench_kernels.py --batches: on a 2-core AVX2 box the kernel still
# won at 96 rows of a 768x2048 Q4_K matrix; 64 leaves a margin).
FAST_BATCH_MAX = 64

# From this many rows of x on, a product dequantizes W by ggml's to_float (bfloat16 in "q8" mode for
# one AMX matmul, float32 in "q8x2") instead of the 8-bit kernel, whose time grows with every row:
# (dequantize ms + 0.1) / (ms per row of the kernel) for a 768x2048 matrix at 1 thread
# (bench/bench_kernels.py --prompt-crossover, "q8"). IQ2/IQ3 dequantize slowly in ggml, Q8_0/Q4_K fast.
PROMPT_MIN_ROWS = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 20, "Q5_1": 20, "Q8_0": 8, "Q2_K": 32, "Q3_K": 28,
                 "Q4_K": 12, "Q5_K": 12, "Q6_K": 32, "IQ2_XXS": 52, "IQ2_XS": 44, "IQ2_S": 48,
                 "IQ3_XXS": 40, "IQ3_S": 32, "IQ1_S": 12, "IQ1_M": 12, "IQ4_NL": 20, "IQ4_XS": 24,
                 "MXFP4": 20}
# The same for the float32 product of "q8x2" (the default) where no AMX product applies (an AVX2
# CPU): ggml's float32 dequantization + one FMA matmul against the q8x2 kernel, both timed at each
# row count (bench/bench_kernels.py --prompt-crossover, 1 thread, CPU time, AVX2 Zen 3). The IQ2/IQ3
# types never cross below FAST_BATCH_MAX (their ggml dequantizers take ~10 ms per 768x2048).
PROMPT_MIN_ROWS_F32 = {"Q4_0": 12, "Q4_1": 24, "Q5_0": 16, "Q5_1": 24, "Q8_0": 12, "Q2_K": 32, "Q3_K": 40,
                       "Q4_K": 20, "Q5_K": 20, "Q6_K": 32, "IQ2_XXS": 64, "IQ2_XS": 48, "IQ2_S": 64,
                       "IQ3_XXS": 64, "IQ3_S": 64, "IQ1_S": 24, "IQ1_M": 32, "IQ4_NL": 24, "IQ4_XS": 40,
                       "MXFP4": 24}



def prompt_min_rows(dtype: torch.dtype) -> dict[str, int]:
    """PROMPT_MIN_ROWS for a batched product in `dtype`: bfloat16 ("q8") or float32 ("q8x2")."""
    return PROMPT_MIN_ROWS if dtype == torch.bfloat16 else PROMPT_MIN_ROWS_F32


# Switch for comparisons (tests, benchmarks): False sends ResidentExperts down the reference path.
USE_KERNELS = True


def available() -> bool:
    """True when the compiled kernels loaded (else every call takes the reference path)."""
    return _build.load() is not None


ACTIVATIONS = _build.ACTIVATIONS
_activations = _build.default_activations()  # STRATA_ACTIVATIONS; the test suite runs "int16" (conftest)


def set_activations(mode: str) -> None:
    """How the kernels treat x: "q8x2" (default), "q8c", "q8", "int16" or "float32" (exact); see the module doc."""
    global _activations
    if mode not in ACTIVATIONS:
        raise ValueError(f"activations {mode!r} is not one of {', '.join(ACTIVATIONS)}")
    _activations = mode
    _plans.clear()  # which types have a kernel depends on the mode
    _stacked.clear()
    lib = _build.load()
    if lib is not None:
        lib.strata_set_activations(ACTIVATIONS[mode])


def activations() -> str:
    return _activations


def ggml_types() -> tuple[str, ...]:
    """Types whose products take ggml's 8-bit dot products in the q8 modes (empty without ggml)."""
    return tuple(_build.GGML_TYPES) if available() else ()


def kernel_types() -> tuple[GGMLQuantizationType, ...]:
    if not available():
        return ()
    names = dict.fromkeys([*_build.KERNEL_TYPES, *_ggml_only()])
    return tuple(GGMLQuantizationType[name] for name in names)


def _ggml_only() -> list[str]:
    """Types only ggml has kernels for: usable in the q8 modes alone."""
    return [n for n in _build.GGML_TYPES if n not in _build.KERNEL_TYPES] if _activations in ("q8", "q8x2", "q8c") else []


def _type_name(qtype) -> str:
    return GGMLQuantizationType(int(qtype)).name


def has_kernel(qtype) -> bool:
    if not available():
        return False
    name = _type_name(qtype)
    return name in _build.KERNEL_TYPES or name in _ggml_only()


def _ptr(t: torch.Tensor):
    return t.data_ptr()


def qmatmul_fast(x: torch.Tensor, w: QTensor, threads: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T` by the compiled kernel: x (..., in) float, w (out, in) -> float32 (..., out).

    Raises if w's type has no kernel or the library is unavailable; `qmatmul` picks for you.
    """
    lib = _build.load()
    name = _type_name(w.qtype)
    if lib is None or not has_kernel(w.qtype):
        raise RuntimeError(f"no fast CPU kernel for {name}" + (f" ({_build.error()})" if lib is None else ""))
    if name in _build.KERNEL_TYPES:
        suffix, qk, ts = _build.KERNEL_TYPES[name]
    else:
        suffix, (qk, ts) = None, GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    if len(w.shape) != 2:
        raise ValueError(f"qmatmul wants a 2-D weight, got shape {w.shape}")
    rows, cols = w.shape
    if x.shape[-1] != cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {cols}")
    if cols % qk:
        raise ValueError(f"{name} rows must be a multiple of {qk} values, got {cols}")
    raw = _build.raw_bytes(w)
    if raw.numel() != rows * (cols // qk) * ts:
        raise ValueError(f"{name} weight of shape {w.shape} has {raw.numel()} bytes")
    lead = x.shape[:-1]
    xf = x.reshape(-1, cols).to(torch.float32).contiguous()
    b = xf.shape[0]
    if out is None:
        out = torch.empty(b, rows, dtype=torch.float32)
    elif out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != b * rows:
        raise ValueError(f"out must be a contiguous float32 tensor of {b} x {rows} values")
    if b and suffix is not None:
        getattr(lib, f"strata_qmm_{suffix}")(_ptr(raw), rows, cols, _ptr(xf), b, _ptr(out), _build.pool_threads(threads))
    elif b and not lib.strata_qmm_ext(int(w.qtype), _ptr(raw), rows, cols, _ptr(xf), b, _ptr(out),
                                      _build.pool_threads(threads), (cols // qk) * ts):
        raise RuntimeError(f"ggml's kernel for {name} refused a {rows}x{cols} product")
    return out.reshape(*lead, rows)


class _Plan(NamedTuple):
    """What a product by one weight needs, worked out once: its kernel bound to its bytes."""
    call: Callable[[int, int, int, int], None]  # (x pointer, batch rows, y pointer, threads)
    rows: int
    cols: int
    copy: torch.Tensor | None  # the contiguous copy the call points at, when w.raw was not contiguous
    ptr: int  # address of the bytes the call reads
    fnptr: int | None  # strata_qmm_<type> for strata_moe_token (None: a ggml-only type)


_plans = plan_cache.PlanCache()  # w.raw -> its _Plan (None: no kernel applies)


def _make_plan(w: QTensor) -> _Plan | None:
    lib = _build.load()
    if lib is None or len(w.shape) != 2 or w.raw.device.type != "cpu" or not has_kernel(w.qtype):
        return None
    name = _type_name(w.qtype)
    rows, cols = w.shape
    raw = _build.raw_bytes(w)
    if name in _build.KERNEL_TYPES:
        _, qk, ts = _build.KERNEL_TYPES[name]
        fn = getattr(lib, f"strata_qmm_{_build.KERNEL_TYPES[name][0]}")
        ptr, fnptr = raw.data_ptr(), ctypes.cast(fn, ctypes.c_void_p).value

        def call(xp, b, yp, nth):
            fn(ptr, rows, cols, xp, b, yp, nth)
    else:
        qk, ts = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        fn, t, ptr, wrow = lib.strata_qmm_ext, int(w.qtype), raw.data_ptr(), (cols // qk) * ts
        fnptr = None

        def call(xp, b, yp, nth):
            if not fn(t, ptr, rows, cols, xp, b, yp, nth, wrow):
                raise RuntimeError(f"ggml's kernel for {name} refused a {rows}x{cols} product")
    if cols % qk or raw.numel() != rows * (cols // qk) * ts:
        return None
    copy = None if raw.untyped_storage().data_ptr() == w.raw.untyped_storage().data_ptr() else raw
    return _Plan(call, rows, cols, copy, ptr, fnptr)


def _plan(w: QTensor) -> _Plan | None:
    """The cached plan for w (None: no kernel applies), dropped when w's bytes are freed."""
    return _plans.get(w.raw, (w.qtype, w.shape), _make_plan, w)


def try_qmatmul(x: torch.Tensor, w: QTensor, threads: int | None = None) -> torch.Tensor | None:
    """`x @ w.T` in x's dtype by the compiled kernel when one applies (CPU tensors, 1 to
    FAST_BATCH_MAX rows, a kernel for w's type), else None: the decode hot path, a few
    microseconds of Python per product."""
    if not USE_KERNELS or x.device.type != "cpu":
        return None
    p = _plan(w)
    if p is None:
        return None
    cols = x.shape[-1]
    b = x.numel() // cols if cols else 0
    if cols != p.cols or not 0 < b <= FAST_BATCH_MAX:
        return None
    xf = x if x.dtype is torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    out = torch.empty(*x.shape[:-1], p.rows)
    p.call(xf.data_ptr(), b, out.data_ptr(), _build.pool_threads(threads))
    return out if x.dtype is torch.float32 else out.to(x.dtype)


def dequantize_ggml(w: QTensor, dtype: torch.dtype = torch.bfloat16, threads: int | None = None) -> torch.Tensor | None:
    """W as bfloat16 or float32 by ggml's own dequantizer on the thread pool (None without ggml
    for its type)."""
    lib = _build.load()
    name = _type_name(w.qtype)
    if lib is None or name not in _build.GGML_TYPES or len(w.shape) != 2 or w.raw.device.type != "cpu":
        return None
    rows, cols = w.shape
    qk, ts = GGML_QUANT_SIZES[GGMLQuantizationType(int(w.qtype))]
    raw = _build.raw_bytes(w)
    if cols % qk or raw.numel() != rows * (cols // qk) * ts:
        return None
    out = torch.empty(rows, cols, dtype=dtype)
    if not lib.strata_dequant(int(w.qtype), raw.data_ptr(), rows, cols, (cols // qk) * ts, out.data_ptr(),
                              1 if dtype == torch.bfloat16 else 0, _build.pool_threads(threads)):
        return None
    return out


# From this many rows of x on, a type with its own AVX-512 dequantizer in prefill.c takes the AMX
# product (`try_qmatmul_prompt`); others need PROMPT_MIN_ROWS (ggml's dequantizer is slower). At 768x2048,
# 1 thread (bench/bench_kernels.py --prompt-amx): the AMX product ~0.4 ms flat, the 8-bit kernel
# 0.06-0.12 ms a row.
PROMPT_AMX_MIN_ROWS = 6
# The same for the AVX2 + FMA float32 backend (prompt.backend() "avx2", a CPU without AMX): from this
# many rows of x its product (own AVX2 decoders into float32 tiles + an FMA micro-kernel) beats the
# q8x2 decode kernel (bench/bench_kernels.py --prompt-avx2 --threads 1, CPU ms, 768x2048, AVX2 Zen 3);
# from there on it also beats ggml's float32 dequantization + one torch matmul at every row count.
# Measured (avx2 / q8x2 ms): Q4_K 12 rows 2.53/2.69, Q6_K 10 2.38/2.42, IQ2_XS 6 1.74/1.90; at 32
# rows Q4_K 3.91/6.90 (ggml f32 + matmul 5.10), IQ2_XS 3.78/10.16 (16.99). The 32-value types since
# their kernels take x in 16 bits: Q4_0 12 / 16 rows 2.11/2.04, 2.05/2.59; Q4_1 2.18/2.06, 2.15/2.73;
# IQ4_NL 2.06/2.04, 2.11/2.66; Q5_1 2.31/2.22, 2.33/2.88; Q5_0 10 / 12 2.21/1.88, 2.21/2.35; Q8_0 6 / 8
# 1.49/1.27, 1.52/1.70.
PROMPT_AVX2_MIN_ROWS = {"Q4_0": 16, "Q4_1": 16, "Q5_0": 12, "Q5_1": 16, "Q8_0": 8, "Q4_K": 12, "Q5_K": 12,
                        "Q6_K": 10, "IQ2_XXS": 6, "IQ2_XS": 6, "IQ4_NL": 16, "IQ4_XS": 10}


# IQ2_XS and IQ2_XXS where their q8x2 kernels are the AVX-512 VBMI byte-permute ones (qmm.c's
# dot2_iq2_xs_perm): the 8-bit kernel wins to 12 rows (CPU ms, 768x2048, 1 thread, Zen 5, with the
# AVX-512 float32 tile: IQ2_XS 12 rows 0.34 against 0.40, 16 rows 0.47 against 0.40; IQ2_XXS 0.32
# against 0.35, 0.46 against 0.35).
PROMPT_AVX2_MIN_ROWS_PERM = 14


def _prompt_min_rows(qtype) -> int:
    """The fewest rows from which `qtype` takes the prompt product with its own decoder."""
    if prompt.backend() == "avx2":
        name = _type_name(qtype)
        if name in ("IQ2_XS", "IQ2_XXS") and _activations in ("q8x2", "q8c") and _build.load().strata_perm_kernel(int(qtype)):
            return PROMPT_AVX2_MIN_ROWS_PERM
        return PROMPT_AVX2_MIN_ROWS.get(name, 8)
    return PROMPT_AMX_MIN_ROWS

_prompt_state = threading.local()


class prompt_batches:
    """`with kernels.prompt_batches():` marks a prompt's forward (`runtime.generate.prefill`), on this
    thread: its quantized products of PROMPT_AMX_MIN_ROWS to FAST_BATCH_MAX rows take the AMX product
    (`try_qmatmul_prompt`, 2-5x less CPU at 8-32 rows) before the decode kernels. Outside it a batch of
    that size (a verify pass, a decode batch) keeps the decode kernels, whose rows each equal a
    one-token step. Where those products run (kernels on, the 8-bit modes, AMX), torch runs the
    forward's other operators on one thread (`threads.torch_team_for_large_only`)."""

    def __enter__(self):
        _prompt_state.depth = getattr(_prompt_state, "depth", 0) + 1
        self.team = None
        if USE_KERNELS and _activations in ("q8", "q8x2", "q8c") and prompt.available():
            self.team = torch_threads.torch_team_for_large_only().__enter__()
        return self

    def __exit__(self, *exc):
        _prompt_state.depth -= 1
        if self.team is not None:
            self.team.__exit__(*exc)
        return False


def in_prompt() -> bool:
    """Whether this thread is inside `prompt_batches()`."""
    return getattr(_prompt_state, "depth", 0) > 0


def _prompt_rows(x: torch.Tensor) -> int:
    """x's rows where a prompt product may take them, else 0: kernels on, the 8-bit modes, a CPU x,
    and inside `prompt_batches()` or above FAST_BATCH_MAX rows (where the decode kernels stop). A
    verify pass or a decode batch of fewer rows keeps the decode kernels, so each of its rows equals
    its one-token step (and a verify pass picks the tokens plain decode would)."""
    if not USE_KERNELS or _activations not in ("q8", "q8x2", "q8c") or x.device.type != "cpu":
        return 0
    n = x.numel() // max(x.shape[-1], 1)
    return n if n > FAST_BATCH_MAX or in_prompt() else 0


def try_qmatmul_prompt(x: torch.Tensor, w: QTensor, threads: int | None = None) -> torch.Tensor | None:
    """`x @ w.T` by prefill.c's AMX product for a prompt-sized batch ("q8x2": x and W split into two
    bfloat16 parts each, ~float32 accuracy; "q8": one bfloat16 product), in x's dtype; None where it
    does not apply (int16 / exact activations, too few rows or not a prompt (`_prompt_rows`), no AMX,
    no dequantizer for the type)."""
    n = _prompt_rows(x)
    if n < PROMPT_AMX_MIN_ROWS or not prompt.has_type(w.qtype):
        return None
    own = prompt.has_type(w.qtype, own_only=True)
    if n < (_prompt_min_rows(w.qtype) if own else PROMPT_MIN_ROWS.get(_type_name(w.qtype), 32)):
        return None
    y = prompt.matmul(x, w, threads, 1 if _activations == "q8" else 3)
    return None if y is None else y.to(x.dtype)


def _prompt_experts(x: torch.Tensor, ws: tuple[QTensor, ...]):
    """(terms, small kernels, min rows) for prefill.c's expert calls over x's rows, or None where
    they do not apply (the modes, the kernels, the types)."""
    n = _prompt_rows(x)
    if n < PROMPT_AMX_MIN_ROWS or not prompt.available():
        return None
    small, mins = [], []
    for w in ws:
        if not prompt.has_type(w.qtype):
            return None
        own = prompt.has_type(w.qtype, own_only=True)
        pl = _plan(w if len(w.shape) == 2 else w[0])
        small.append(pl.fnptr if pl is not None else None)
        mins.append(_prompt_min_rows(w.qtype) if own else PROMPT_MIN_ROWS.get(_type_name(w.qtype), 32))
    if any(s is None for s in small) and n < max(mins):
        return None
    return (1 if _activations == "q8" else 3), small, mins


def _batched_ok(x: torch.Tensor, w: QTensor) -> bool:
    name = _type_name(w.qtype)
    table = prompt_min_rows(torch.bfloat16 if _activations == "q8" else torch.float32)
    return (w.raw.device.type == "cpu" and name in _build.GGML_TYPES
            and _prompt_rows(x) >= table.get(name, 32))


def _prompt_ok(x: torch.Tensor, w: QTensor) -> bool:
    return (w.raw.device.type == "cpu" and _prompt_rows(x) >= _prompt_min_rows(w.qtype)
            and prompt.has_type(w.qtype, own_only=True))


def try_qmatmul_batched(x: torch.Tensor, w: QTensor, threads: int | None = None) -> torch.Tensor | None:
    """`x @ w.T` for a prompt-sized batch (at least PROMPT_MIN_ROWS rows): W dequantized by ggml
    and one matmul, in bfloat16 ("q8": oneDNN / AMX) or float32 ("q8x2"), returned in x's dtype;
    None when it does not apply (int16 / exact activations, too few rows, no ggml, not the CPU)."""
    y = try_qmatmul_prompt(x, w, threads)
    return y if y is not None else try_qmatmul_dequantized(x, w, threads)


def try_qmatmul_dequantized(x: torch.Tensor, w: QTensor, threads: int | None = None) -> torch.Tensor | None:
    """`try_qmatmul_batched` without its AMX product: W dequantized by ggml, one matmul (for a
    caller that tried `try_qmatmul_prompt` already)."""
    if not _batched_ok(x, w):
        return None
    dt = torch.bfloat16 if _activations == "q8" else torch.float32
    wd = dequantize_ggml(w, dt, threads)
    if wd is None:
        return None
    with torch_threads.one_thread_if_small(x.numel() * w.shape[0]):  # a prompt's: the team
        return F.linear(x.to(dt), wd).to(x.dtype)


def qmatmul_reference(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """The plain path: dequantize w whole, then one matmul (in x's dtype)."""
    return F.linear(x, w.dequantize(x.dtype))


def fast_ok(x: torch.Tensor, *ws: QTensor) -> bool:
    """Whether `qmatmul_fast` applies: CPU tensors, at most FAST_BATCH_MAX rows, kernels for ws."""
    if x.device.type != "cpu" or x.numel() // max(x.shape[-1], 1) > FAST_BATCH_MAX:
        return False
    return all(w.raw.device.type == "cpu" and has_kernel(w.qtype) for w in ws)


def qmatmul(x: torch.Tensor, w: QTensor, threads: int | None = None) -> torch.Tensor:
    """`x @ w.T` in x's dtype: the batched product for prompt-sized batches, the fast kernel for
    a few rows, else the reference."""
    y = try_qmatmul_batched(x, w, threads)
    if y is None:
        y = try_qmatmul(x, w, threads)
    return y if y is not None else qmatmul_reference(x, w)


def expert_forward(x: torch.Tensor, gate_q: QTensor, up_q: QTensor, down_q: QTensor,
                   threads: int | None = None) -> torch.Tensor:
    """One SwiGLU expert, down(silu(gate x) * up x), on x (n, hidden) -> (n, hidden) in x's dtype.

    Each of the three products takes the batched product for a prompt-sized batch, the
    compiled kernel for a few rows, else the reference; when none of them has a fast path this
    is exactly `expert_forward_reference`.
    """
    spec = _prompt_experts(x, (gate_q, up_q, down_q))
    if spec is not None:  # a prompt's rows: one C call (prefill.c)
        y = prompt.swiglu(x, gate_q, up_q, down_q, threads, *spec)
        if y is not None:
            return y.to(x.dtype)
    if not any(_batched_ok(x, w) or _prompt_ok(x, w) or fast_ok(x, w) for w in (gate_q, up_q, down_q)):
        return expert_forward_reference(x, gate_q, up_q, down_q)

    def mm(v, w):
        y = try_qmatmul_batched(v, w, threads)
        if y is None:
            y = try_qmatmul(v, w, threads)
        return y if y is not None else qmatmul_reference(v, w)

    xf = x.float()
    h = F.silu(mm(xf, gate_q)).mul_(mm(xf, up_q))
    return mm(h, down_q).to(x.dtype)


def expert_forward_reference(x: torch.Tensor, gate_q: QTensor, up_q: QTensor, down_q: QTensor) -> torch.Tensor:
    gate, up, down = (w.dequantize(x.dtype) for w in (gate_q, up_q, down_q))
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def experts_fast_ok(x: torch.Tensor, *stacked: QTensor) -> bool:
    """Whether `grouped_swiglu` applies: kernels loaded, CPU tensors, every type has a kernel.

    Batch size is not checked here; each expert falls back to the reference on its own when
    it receives more than FAST_BATCH_MAX tokens.
    """
    if not USE_KERNELS or x.device.type != "cpu":
        return False
    return all(w.raw.device.type == "cpu" and has_kernel(w.qtype) for w in stacked)


def _swiglu_shapes(first: list[_Plan], hidden: int) -> bool:
    """Whether (gate, up, down) plans are one SwiGLU expert over `hidden` features."""
    g0, u0, d0 = first
    ffn = g0.rows
    return (g0.cols, u0.rows, u0.cols, d0.rows, d0.cols) == (hidden, ffn, hidden, hidden, ffn)


def _parts_ptrs(parts, hidden: int):
    """(gate, up, down pointer arrays, their 3 kernels, ffn) of the experts `parts` (each its
    (gate, up, down) QTensors: a tier's source) for strata_moe_token(s), or None where they do not
    apply: a matrix without an own kernel, or the experts' types or shapes differ."""
    plans = [[_plan(q) for q in p] for p in parts]
    first = plans[0]
    if any(pl is None or pl.fnptr is None for pl in first) or not _swiglu_shapes(first, hidden):
        return None
    for pl in plans[1:]:
        for a, b in zip(pl, first):
            if a is None or a.fnptr != b.fnptr or (a.rows, a.cols) != (b.rows, b.cols):
                return None
    vp = ctypes.c_void_p * len(parts)
    return [vp(*(pl[i].ptr for pl in plans)) for i in range(3)], [pl.fnptr for pl in first], first[0].rows


def _stacked_ptrs(stacked: tuple[QTensor, QTensor, QTensor], ids: list[int], hidden: int):
    """`_parts_ptrs` for experts `ids` of resident stacked experts, each expert's bytes found from
    the stacked plans (`stacked_plans`)."""
    plans = stacked_plans(stacked, hidden)
    n_exp = stacked[0].shape[0]
    if plans is None or any(not 0 <= e < n_exp for e in ids):
        return None
    vp = ctypes.c_void_p * len(ids)
    return ([vp(*(pl.ptr + e * stride for e in ids)) for pl, stride in plans], [pl.fnptr for pl, _ in plans],
            plans[0][0].rows)


def _call_moe_token(x: torch.Tensor, spec, w: list[float], threads, out: torch.Tensor) -> bool:
    """strata_moe_token over `spec` (`_parts_ptrs` / `_stacked_ptrs`; None: declined, False)."""
    lib = _build.load()
    if spec is None or lib is None:
        return False
    (gp, up, dp), (gf, uf, df), ffn = spec
    hidden, k = x.shape[-1], len(w)
    scratch = torch.empty(3 * ffn + hidden, dtype=torch.float32)
    lib.strata_moe_token(gp, up, dp, (ctypes.c_float * k)(*w), k, gf, uf, df, hidden, ffn, x.data_ptr(),
                         out.data_ptr(), scratch.data_ptr(), _build.pool_threads(threads))
    return True


def _f32(x: torch.Tensor, out: torch.Tensor) -> bool:
    return x.dtype is torch.float32 and out.dtype is torch.float32 and x.is_contiguous()


def _moe_token(x: torch.Tensor, parts, w: list[float], threads, out: torch.Tensor) -> bool:
    """One token's routed experts in a single C call (strata_moe_token), accumulated into `out`
    (float32); False (nothing done) when x or out is not float32, a matrix has no own kernel,
    or the experts' types or shapes differ."""
    return _f32(x, out) and _call_moe_token(x, _parts_ptrs(parts, x.shape[-1]), w, threads, out)


def token_expert_kernels(expert: tuple[QTensor, QTensor, QTensor], hidden: int):
    """The kernels strata_moe_token runs for experts laid out as `expert` ((gate, up, down) QTensors
    of one of them), as `moe_token_at` takes them; None where they do not apply. Worked out once per
    layout, so a caller that holds each expert as bytes (a disk home's read) plans nothing per expert."""
    spec = _parts_ptrs([expert], hidden) if _build.load() is not None else None
    return None if spec is None else spec[1:]


def moe_token_at(x: torch.Tensor, ptrs: list[tuple[int, int, int]], expert_kernels, w: list[float], threads,
                 out: torch.Tensor) -> bool:
    """`_moe_token` over experts given by the addresses of their (gate, up, down) bytes, laid out as
    `expert_kernels` (`token_expert_kernels`) says: the same C call, so the same result. False
    (nothing done) where x or out is not float32 or `expert_kernels` is None."""
    if not USE_KERNELS or expert_kernels is None or not _f32(x, out):
        return False
    vp = ctypes.c_void_p * len(ptrs)
    return _call_moe_token(x, ([vp(*(p[i] for p in ptrs)) for i in range(3)], *expert_kernels), w, threads, out)


_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_MOE_TOKENS_ARGTYPES = (_P, _P, _P, _P, ctypes.c_int, _P, _P, _P, _P, _P, _P, _I64, _I64, _P, _P, ctypes.c_int)


def _moe_tokens_fn():
    """strata_moe_tokens with its argument types declared, or None without the entry point."""
    return _build.entry("strata_moe_tokens", _MOE_TOKENS_ARGTYPES, ctypes.c_int)


def moe_tokens_at(x: torch.Tensor, parts: tuple[int, int, int], expert_kernels, tokens: list[int],
                  w: list[float], threads, out: torch.Tensor) -> bool:
    """One expert over a few rows of x (`tokens`, ascending, with their router weights `w`), given by
    the addresses of its (gate, up, down) bytes laid out as `expert_kernels` (`token_expert_kernels`)
    says: out[t] += w * expert(x[t]) in one strata_moe_tokens call (the call `_moe_tokens` makes for
    resident experts), no route table, QTensor views or plans per expert. False (nothing done) where
    x or out is not float32, `expert_kernels` is None or the entry point is missing."""
    fn = _moe_tokens_fn() if USE_KERNELS and expert_kernels is not None and _f32(x, out) else None
    if fn is None or not tokens:
        return False
    (gf, uf, df), ffn = expert_kernels
    n = len(tokens)
    one = ctypes.c_void_p * 1
    ints = ctypes.c_int64 * n
    return bool(fn(one(parts[0]), one(parts[1]), one(parts[2]), (ctypes.c_int64 * 1)(n), 1, ints(*tokens),
                   (ctypes.c_float * n)(*w), ints(*range(n)), gf, uf, df, x.shape[-1], ffn, x.data_ptr(),
                   out.data_ptr(), _build.pool_threads(threads)))


# id(stacked raw) -> (plan of expert 0, bytes from one expert to the next) or None
_stacked = plan_cache.PlanCache()


def _make_stacked_plan(q: QTensor):
    raw = q.raw
    if len(q.shape) == 3 and raw.device.type == "cpu" and raw.is_contiguous():
        pl = _plan(q[0])
        if pl is not None and pl.fnptr is not None and pl.copy is None:
            return pl, raw.stride(0) * raw.element_size()
    return None


def _stacked_plan(q: QTensor):
    """The plan of a stacked `[E, out, in]` QTensor's expert 0 and the stride to the next, worked out
    once (an expert's slice is a new view each time, which `_plan` would plan anew)."""
    return _stacked.get(q.raw, None, _make_stacked_plan, q)


def stacked_plans(stacked: tuple[QTensor, QTensor, QTensor], hidden: int):
    """The stacked gate, up, down's (expert-0 plan, bytes to the next expert) for the one-call expert
    products (strata_moe_token(s), strata_moe_decode), or None where they do not apply: a matrix
    without an own kernel, not one SwiGLU over `hidden`, or not the same number of experts."""
    plans = [_stacked_plan(q) for q in stacked]
    if (any(pl is None for pl in plans) or not _swiglu_shapes([pl for pl, _ in plans], hidden)
            or any(q.shape[0] != stacked[0].shape[0] for q in stacked)):
        return None
    return plans


def _moe_tokens(x: torch.Tensor, table: RouteTable, experts, threads, out: torch.Tensor) -> bool:
    """The routed experts of a few tokens in one C call (strata_moe_tokens: each used expert once
    over its tokens), accumulated into `out` (float32); `experts` the stacked gate, up, down
    `[E, out, in]` (resident) or a list of each used expert's (gate, up, down), in the table's order
    (a tier's source). False (nothing done) where `_moe_token` would refuse, or without the entry point.

    Each token adds its experts in the order its one-token step does (strata_moe_token adds them in
    its table's order), so each position of a verify pass sums as a decode step does: resident
    experts by descending weight (a top-k router's order, which a one-token table keeps; a router
    whose k weights are not sorted, or tie, differs by rounding); a tier's source in the table's
    order (the tiers' tables keep a set of experts, sorted by expert for one token too)."""
    fn = _moe_tokens_fn()
    if fn is None or not _f32(x, out):
        return False
    used, counts = torch.unique_consecutive(table.expert, return_counts=True)
    used = used.tolist()
    hidden = x.shape[-1]
    stacked = isinstance(experts[0], QTensor)
    spec = _stacked_ptrs(experts, used, hidden) if stacked else _parts_ptrs(experts, hidden)
    if spec is None:
        return False
    (gp, up, dp), (gf, uf, df), ffn = spec
    counts = counts.to(torch.int64).contiguous()
    token = table.token.to(torch.int64).contiguous()
    weight = table.weight.to(torch.float32).contiguous()
    if stacked:
        by_weight = torch.argsort(-weight, stable=True)
        order = by_weight[torch.argsort(token[by_weight], stable=True)].contiguous()  # per token, heaviest first
    else:
        order = torch.argsort(token, stable=True)  # per token, in the table's order
    return bool(fn(gp, up, dp, counts.data_ptr(), len(used), token.data_ptr(), weight.data_ptr(), order.data_ptr(),
                   gf, uf, df, hidden, ffn, x.data_ptr(), out.data_ptr(), _build.pool_threads(threads)))


def _moe_token_stacked(x: torch.Tensor, table: RouteTable, stacked: tuple[QTensor, QTensor, QTensor], threads,
                       out: torch.Tensor) -> bool:
    """`_moe_token` for resident stacked experts: each expert's bytes found from the stacked plans
    (`_stacked_plan`), not by slicing k x 3 views and planning each anew (24 new plans per layer on
    a qwen3 token, ~0.3 ms of Python); the same C call, so the same result. False where it declines."""
    if not _f32(x, out):
        return False
    spec = _stacked_ptrs(stacked, table.expert.tolist(), x.shape[-1])
    return _call_moe_token(x, spec, table.weight.tolist(), threads, out)


def grouped_swiglu(x: torch.Tensor, table: RouteTable, experts: ExpertSource,
                   threads: int | None = None) -> torch.Tensor:
    """The grouped expert product (`strata.kernels.grouped`) by these kernels: a decode token's
    experts in one C call (strata_moe_token), a few tokens' in one (strata_moe_tokens), else the
    one grouping loop with `expert_forward`."""
    source = grouped.as_source(experts)
    # resident experts of a prompt: the whole layer in one C call (prefill.c)
    if not callable(experts) and x.shape[0] > FAST_BATCH_MAX and table.expert.numel() and x.dtype is torch.float32:
        spec = _prompt_experts(x, experts)
        if spec is not None:
            used, counts = torch.unique_consecutive(table.expert, return_counts=True)
            out = prompt.moe(x.contiguous(), used, counts, table.token, table.weight, experts, threads, *spec)
            if out is not None:
                return out
    # a verify pass or a decode batch: one call, each row as its one-token step computes it
    # (resident experts; a tier's source outside a prompt too, whose prompt rows take prefill.c
    # per expert in the loop below)
    if 1 < x.shape[0] <= FAST_BATCH_MAX and table.expert.numel() and (not callable(experts) or not in_prompt()):
        if callable(experts):  # each used expert asked once: the loop below reuses them
            have = {e: source(e) for e in torch.unique_consecutive(table.expert).tolist()}
            experts, source = list(have.values()), have.__getitem__
        out = torch.zeros_like(x)
        if _moe_tokens(x, table, experts, threads, out):
            return out
    if x.shape[0] == 1 and table.expert.numel():  # decode: one token, no grouping needed
        out = torch.zeros_like(x)
        if not callable(experts) and _moe_token_stacked(x, table, experts, threads, out):
            return out
        parts, w = [source(e) for e in table.expert.tolist()], table.weight.tolist()
        if _moe_token(x, parts, w, threads, out):
            return out
        for p, wj in zip(parts, w):
            out.add_(expert_forward(x, *p, threads=threads), alpha=wj)
        return out
    return grouped.grouped_swiglu(x, table, source, lambda xs, g, u, d: expert_forward(xs, g, u, d, threads))


def run_experts_fast(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert,
                     threads: int | None = None) -> torch.Tensor:
    """`grouped_swiglu` over a router's (ids, weights) (N, k); expert(e) -> (gate_q, up_q, down_q)."""
    return grouped_swiglu(x, grouped.route_table(ids, weights), expert, threads)
