"""llama.cpp's CPU dot products (libggml-cpu) as the default kernels of strata/kernels.

ggml's per-type `vec_dot` (weights in their ggml blocks against activations quantized once per
product to q8_0 / q8_1 / q8_K) beat the own decoders 1.3-3x per matrix-vector product on this
machine (bench/bench_kernels.py --compare-ggml), so qmm.c calls them through function pointers
on its own thread pool; for prefill, ggml's `to_float` dequantizes weights to bfloat16 for
torch's bf16 matmul (oneDNN / AMX). The library comes from an installed ggml-python (`pip install
ggml-python`, a source build of about a minute) or llama-cpp-python, or STRATA_GGML_LIB (a
libggml-cpu.so path); STRATA_GGML=0 or no such library leaves the own kernels in charge.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

log = logging.getLogger(__name__)

# ggml type ids qmm.c may route to ggml: every block type of the MoE releases.
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
              "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20,
              "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29, "MXFP4": 39}


class _TypeTraits(ctypes.Structure):  # ggml.h: struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


class _TypeTraitsCpu(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


def _candidates() -> list[Path]:
    env = os.environ.get("STRATA_GGML_LIB")
    if env:
        return [Path(env)]
    out = []
    for pkg in ("ggml", "llama_cpp"):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        if spec and spec.origin:  # locate only: importing either package costs seconds
            out.append(Path(spec.origin).parent / "lib" / "libggml-cpu.so")
    return out


_libs: list[ctypes.CDLL] = []  # kept loaded for the process's lifetime
_source: str | None = None


def source() -> str | None:
    """The libggml-cpu.so in use, or None."""
    return _source


def register(kernels: ctypes.CDLL) -> list[str]:
    """Hand ggml's dot products to the kernel library; returns the type names registered."""
    global _source
    if os.environ.get("STRATA_GGML", "1").lower() in ("0", "off", "false", "no"):
        return []
    for path in _candidates():
        if not path.exists():
            continue
        try:
            # RTLD_LOCAL: llama-cpp-python may load another ggml build into this process; neither
            # may resolve the other's symbols
            cpu = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
            base = ctypes.CDLL(str(path.with_name("libggml-base.so")), mode=ctypes.RTLD_LOCAL)
            cpu.ggml_cpu_init.restype = None
            cpu.ggml_cpu_init()
            cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
            cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
            base.ggml_blck_size.restype = ctypes.c_int64
            base.ggml_type_size.restype = ctypes.c_size_t
            base.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
            base.ggml_get_type_traits.argtypes = [ctypes.c_int]
        except (OSError, AttributeError) as e:
            log.warning("strata: %s unusable (%s); keeping the own CPU kernels", path, e)
            continue
        names = []
        for name, t in GGML_TYPES.items():
            tr = cpu.ggml_get_type_traits_cpu(t).contents
            vt = tr.vec_dot_type
            act = cpu.ggml_get_type_traits_cpu(vt).contents
            if not tr.vec_dot or not act.from_float or tr.nrows != 1:
                continue
            kernels.strata_set_ext(t, tr.vec_dot, act.from_float, base.ggml_blck_size(vt), base.ggml_type_size(vt))
            names.append(name)
            traits = base.ggml_get_type_traits(t).contents
            if traits.to_float and traits.blck_size == GGML_QUANT_SIZES[GGMLQuantizationType(t)][0]:
                kernels.strata_set_to_float(t, traits.to_float)
        _libs[:] = [base, cpu]
        _source = str(path)
        return names
    return []
