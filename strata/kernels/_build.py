"""Compile the kernel library (qmm.c and the other SOURCES) once per machine and load it with ctypes.

The library is cached under $STRATA_CACHE (default ~/.cache/strata)/kernels, keyed by a hash of
the source, the compiler and the flags, so a source edit or a new CPU (-march=native) rebuilds
it. Compiling takes about 5 s of CPU with gcc 12 (once; later loads take milliseconds). No compiler, a failed build or STRATA_KERNELS=0
means no fast kernels: `load()` returns None and callers use the torch reference path.
qmm.c's one-pass q8x2 kernels come in AVX-512 VNNI, AVX-VNNI and AVX2 sets (the 256-bit ones
build whatever -march says); the library picks the best the CPU runs from cpuid, and
STRATA_KERNEL_ISA=avx2|avxvnni|avx512vnni forces one (tests and bench_kernels --fused-ab compare them).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from strata.kernels.threads import kernel_threads

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qmm.c")
SOURCES = [SOURCE, Path(__file__).with_name("pool.c"),  # one library: these all run on pool.c's thread pool
           Path(__file__).with_name("hc_mix.c"), Path(__file__).with_name("prefill.c"),
           Path(__file__).with_name("causal_conv.c"), Path(__file__).with_name("deltanet_decode.c"),
           Path(__file__).with_name("decode_attention.c"), Path(__file__).with_name("decode_stack.c"),
           Path(__file__).with_name("gdn_prompt.c")]
HEADERS = [Path(__file__).with_name("qmm_avx2.h"), Path(__file__).with_name("prefill_avx2.h"),  # included: part of the cache key
           Path(__file__).with_name("blocks.h"), Path(__file__).with_name("pool.h")]
FLAGS = ["-O3", "-march=native", "-pthread", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno"]
ABI_VERSION = 10

# ggml type name -> (C suffix, block size, type size); the types qmm.c implements.
KERNEL_TYPES = {
    "Q4_0": ("q4_0", 32, 18),
    "Q4_1": ("q4_1", 32, 20),
    "Q5_0": ("q5_0", 32, 22),
    "Q5_1": ("q5_1", 32, 24),
    "Q8_0": ("q8_0", 32, 34),
    "Q2_K": ("q2_k", 256, 84),
    "Q3_K": ("q3_k", 256, 110),
    "Q4_K": ("q4_k", 256, 144),
    "Q5_K": ("q5_k", 256, 176),
    "Q6_K": ("q6_k", 256, 210),
    "IQ2_XXS": ("iq2_xxs", 256, 66),
    "IQ2_XS": ("iq2_xs", 256, 74),
    "IQ3_XXS": ("iq3_xxs", 256, 98),
    "IQ4_NL": ("iq4_nl", 32, 18),
    "IQ4_XS": ("iq4_xs", 256, 136),
    "MXFP4": ("mxfp4", 32, 17),
}

# The one-pass q8x2 kernel sets (qmm.c picks the best the CPU runs; STRATA_KERNEL_ISA forces one).
KERNEL_ISAS = {"avx2": 1, "avxvnni": 2, "avx512vnni": 3}

# How the kernels treat x (kernels.set_activations): qmm.c's act_mode values.
ACTIVATIONS = {"float32": 0, "int16": 1, "q8": 2, "q8x2": 3, "q8c": 4}


def default_activations() -> str:
    """STRATA_ACTIVATIONS if it names a mode, else "q8x2"."""
    mode = os.environ.get("STRATA_ACTIVATIONS", "q8x2")
    return mode if mode in ACTIVATIONS else "q8x2"


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_tables: list[np.ndarray] = []  # kept alive for the library's lifetime
GGML_TYPES: list[str] = []  # types whose products go through ggml's dot products (see _ggml.py)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cache_dir() -> Path:
    root = os.environ.get("STRATA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "strata")
    return Path(root) / "kernels"


def _cpu_key() -> str:
    """Part of the cache key: -march=native code must not run on another CPU model."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str) -> Path:
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + version.encode() + _cpu_key().encode())
    out = _cache_dir() / f"qmm-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders both end with a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _init_tables(lib: ctypes.CDLL) -> None:
    import gguf.quants as gq

    grids = []
    for name in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"):
        ref = getattr(gq, name)
        ref.init_grid()
        g = np.asarray(ref.grid, dtype=np.float32).reshape(ref.grid_shape)
        grids.append(np.ascontiguousarray(g.astype(np.uint8)))
    ksigns = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()
    _tables[:] = [*grids, ksigns]
    lib.strata_init_tables(*(t.ctypes.data_as(ctypes.c_void_p) for t in _tables))
    iq = []
    for name, dtype in (("IQ1_S", np.int8), ("IQ2_S", np.uint8), ("IQ3_S", np.uint8)):
        ref = getattr(gq, name)
        ref.init_grid()
        iq.append(np.ascontiguousarray(np.asarray(ref.grid, dtype=np.float32).reshape(ref.grid_shape).astype(dtype)))
    lib.strata_init_tables_iq(*(t.ctypes.data_as(ctypes.c_void_p) for t in iq))  # copied by the library


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for suffix, _, _ in KERNEL_TYPES.values():
        f = getattr(lib, f"strata_qmm_{suffix}")
        f.argtypes = [p, i64, i64, p, i64, p, ctypes.c_int]
        f.restype = None
    lib.strata_moe_token.argtypes = [p, p, p, p, ctypes.c_int, p, p, p, i64, i64, p, p, p, ctypes.c_int]
    lib.strata_moe_token.restype = None
    lib.strata_init_tables.argtypes = [p, p, p, p]
    lib.strata_init_tables.restype = None
    lib.strata_init_tables_iq.argtypes = [p, p, p]
    lib.strata_init_tables_iq.restype = None
    lib.strata_set_fused_isa.argtypes = [ctypes.c_int]
    lib.strata_set_fused_isa.restype = ctypes.c_int
    lib.strata_fused_isas.restype = ctypes.c_int
    lib.strata_fused_isa.restype = ctypes.c_int
    lib.strata_fused_mixed.restype = ctypes.c_int
    lib.strata_set_fused_mixed.argtypes = [ctypes.c_int]
    lib.strata_set_fused_mixed.restype = ctypes.c_int
    lib.strata_abi_version.restype = ctypes.c_int
    lib.strata_set_activations.argtypes = [ctypes.c_int]
    lib.strata_set_activations.restype = None
    lib.strata_set_ext.argtypes = [ctypes.c_int, p, p, i64, i64]
    lib.strata_set_ext.restype = None
    lib.strata_qmm_ext.argtypes = [ctypes.c_int, p, i64, i64, p, i64, p, ctypes.c_int, i64]
    lib.strata_qmm_ext.restype = ctypes.c_int
    lib.strata_rope.argtypes = [p, p, p, i64, i64, i64, i64, ctypes.c_int, p]
    lib.strata_rope.restype = None
    lib.strata_qmm_group.argtypes = [ctypes.c_int, p, p, p, i64, p, i64, p, p, p, ctypes.c_int]
    lib.strata_qmm_group.restype = None
    lib.strata_qmm_many.argtypes = [ctypes.c_int, p, p, p, p, p, p, i64, p, ctypes.c_int]
    lib.strata_qmm_many.restype = ctypes.c_int
    lib.strata_q8k_quantize.argtypes = [p, p, i64]
    lib.strata_q8k_quantize.restype = ctypes.c_int
    lib.strata_pool_jobs.argtypes = []
    lib.strata_pool_jobs.restype = i64
    f32, c_int = ctypes.c_float, ctypes.c_int
    lib.strata_attn_decode.argtypes = [p, i64, p, f32, p, p, p, p, i64, i64, i64, p, p, f32, p, p, i64, c_int,
                                       p, p, i64, i64, p, p, c_int, p, c_int]
    lib.strata_attn_decode.restype = c_int
    lib.strata_ffn_decode.argtypes = [p, i64, p, f32, p, p, i64, p, p, p, c_int]
    lib.strata_ffn_decode.restype = c_int
    lib.strata_moe_decode.argtypes = [p, i64, p, f32, p, i64, c_int, c_int, p, i64, p, i64, p, i64, p, p, p,
                                      i64, p, p, i64, p, p, p, p, c_int]
    lib.strata_moe_decode.restype = c_int
    lib.strata_pool_tiles.argtypes = [p]
    lib.strata_pool_tiles.restype = None
    lib.strata_pool_times.argtypes = [p]
    lib.strata_pool_times.restype = None
    lib.strata_pool_timing.argtypes = [ctypes.c_int]
    lib.strata_pool_timing.restype = None
    lib.strata_pool_trace.argtypes = [ctypes.c_int]
    lib.strata_pool_trace.restype = None
    lib.strata_pool_trace_read.argtypes = [p, i64, i64]
    lib.strata_pool_trace_read.restype = i64
    lib.strata_pool_mark.argtypes = [i64, i64]
    lib.strata_pool_mark.restype = None
    lib.strata_set_pool_yield.argtypes = [i64]
    lib.strata_set_pool_yield.restype = None
    lib.strata_set_min_parallel.argtypes = [i64]
    lib.strata_set_min_parallel.restype = None
    lib.strata_set_fused.argtypes = [ctypes.c_int]
    lib.strata_set_fused.restype = None
    lib.strata_set_multirow.argtypes = [ctypes.c_int]
    lib.strata_set_multirow.restype = None
    lib.strata_multirow_types.argtypes = [ctypes.c_int]
    lib.strata_multirow_types.restype = ctypes.c_int
    lib.strata_perm_kernel.argtypes = [ctypes.c_int]
    lib.strata_perm_kernel.restype = ctypes.c_int
    lib.strata_fused_types.argtypes = [ctypes.c_int]
    lib.strata_fused_types.restype = ctypes.c_int
    lib.strata_set_to_float.argtypes = [ctypes.c_int, p]
    lib.strata_set_to_float.restype = None
    lib.strata_dequant.argtypes = [ctypes.c_int, p, i64, i64, i64, p, ctypes.c_int, ctypes.c_int]
    lib.strata_dequant.restype = ctypes.c_int


def _choose_isa(lib: ctypes.CDLL) -> None:
    """STRATA_KERNEL_ISA=avx2|avxvnni|avx512vnni forces that one-pass kernel set (unset or "auto":
    the best this CPU runs); one the CPU cannot run is refused with a warning."""
    name = os.environ.get("STRATA_KERNEL_ISA", "auto").strip().lower()
    if name in ("", "auto"):
        return
    if name not in KERNEL_ISAS:
        log.warning("strata: STRATA_KERNEL_ISA=%s is not one of auto, %s; using auto", name, ", ".join(KERNEL_ISAS))
    elif lib.strata_set_fused_isa(KERNEL_ISAS[name]) < 0:
        have = [n for n, bit in KERNEL_ISAS.items() if lib.strata_fused_isas() >> bit & 1]
        log.warning("strata: STRATA_KERNEL_ISA=%s: this CPU or build cannot run those kernels (it runs: %s); "
                    "using auto", name, ", ".join(have) or "none")


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (see `error()` for why)."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("STRATA_KERNELS", "1").lower() in ("0", "off", "false", "no"):
                raise RuntimeError("disabled by STRATA_KERNELS=0")
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (set CC, or install gcc)")
            lib = ctypes.CDLL(str(_build(cc)))
            _declare(lib)
            if lib.strata_abi_version() != ABI_VERSION:
                raise RuntimeError("stale kernel library")
            _init_tables(lib)
            from strata.kernels import _ggml

            GGML_TYPES[:] = _ggml.register(lib)
            lib.strata_set_activations(ACTIVATIONS[default_activations()])
            _choose_isa(lib)
            _lib = lib
        except Exception as e:  # noqa: BLE001 -- any failure means "use the reference path"
            _error = str(e)
            log.warning("strata: fast CPU kernels unavailable (%s); using dequantize + matmul", e)
        _tried = True
    return _lib


_entries: dict[str, object] = {}


def entry(name: str, argtypes, restype=None) -> object | None:
    """The library's C function `name` (void unless `restype`), declared with `argtypes` on first
    use; None without the library or where it lacks `name` (for modules that add one entry point each)."""
    lib = load()
    if lib is None:
        return None
    fn = _entries.get(name)
    if fn is None:
        fn = getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = list(argtypes)
        fn.restype = restype
        _entries[name] = fn
    return fn


def pool_threads(threads: int | None) -> int:
    """The kernel pool's threads for one call: `threads` when positive, else torch's count (a
    prompt's: the count before its torch went to one thread, `threads.kernel_threads`)."""
    return int(threads) if threads and threads > 0 else kernel_threads()


def raw_bytes(w) -> torch.Tensor:
    """A QTensor's bytes as the C calls read them: contiguous uint8 (a copy only if the view was strided)."""
    raw = w.raw if w.raw.is_contiguous() else w.raw.contiguous()
    return raw if raw.dtype == torch.uint8 else raw.view(torch.uint8)


def error() -> str | None:
    load()
    return _error
