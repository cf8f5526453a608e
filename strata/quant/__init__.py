"""Decode ggml/GGUF tensor data into float32 torch tensors, bit-exact with gguf-py's numpy reference.

`dequantize(raw, qtype, shape)` is the entry point; one `QuantType` per ggml type does the work,
vectorised over all blocks. Types gguf-py cannot decode itself (Q8_1, Q8_K, Q1_0) are absent,
since there would be no reference to be exact against.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType

from strata.errors import StrataError, UnsupportedQuantType
from strata.quant import floats, iquants, kquants, legacy, mxfp4, ternary  # noqa: F401  (registration)
from strata.quant.base import QuantType, get, register, supported
from strata.quant.fp8 import fp8_e4m3_to_float32

SUPPORTED: tuple[GGMLQuantizationType, ...] = supported()

__all__ = [
    "SUPPORTED",
    "QuantType",
    "dequantize",
    "fp8_e4m3_to_float32",
    "get",
    "quantize_reference",
    "register",
    "row_bytes",
]


def row_bytes(qtype, n_values: int) -> int:
    """Bytes taken by `n_values` consecutive values of one row; n_values must be whole blocks."""
    q = get(qtype)
    if n_values % q.block_size:
        raise StrataError(
            f"{q.name} rows must hold a multiple of {q.block_size} values, got {n_values}",
            "the tensor's innermost dimension does not fit this quantization type",
        )
    return n_values // q.block_size * q.type_size


def _as_bytes(raw) -> torch.Tensor:
    """Flat uint8 view of `raw`'s bytes (numpy array, or torch tensor of any dtype); no copy if contiguous."""
    if isinstance(raw, torch.Tensor):
        t = raw.contiguous()
        return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)
    arr = np.ascontiguousarray(raw)
    arr = arr.reshape(-1).view(np.uint8)
    if not arr.flags.writeable:
        # gguf's reader hands out read-only memmaps; we never write to them, so skip torch's warning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)
    return torch.from_numpy(arr)


def dequantize(raw, qtype, shape: Sequence[int]) -> torch.Tensor:
    """Decode one tensor's bytes to float32 of logical `shape` (outermost dimension first).

    raw: the tensor's bytes as a torch tensor or numpy array of any leading shape (e.g. gguf's
    `[rows, bytes_per_row]`); its bytes are reinterpreted, so F32/F16 arrays work too. Runs on
    raw's device. The result never shares memory with raw.
    """
    q = get(qtype)
    shape = tuple(int(s) for s in shape)
    data = _as_bytes(raw)
    inner = shape[-1] if shape else 1
    if inner % q.block_size:
        raise StrataError(
            f"{q.name} tensor of shape {list(shape)}: innermost dimension {inner} is not a multiple "
            f"of the block size {q.block_size}",
            "the file's tensor info is inconsistent",
        )
    n_values = math.prod(shape)
    want = n_values // q.block_size * q.type_size
    if data.numel() != want:
        raise StrataError(
            f"{q.name} tensor of shape {list(shape)} needs {want} bytes, got {data.numel()}",
            "the file may be truncated, or the tensor's type or shape is wrong",
        )
    blocks = data.reshape(n_values // q.block_size, q.type_size)  # [n_blocks, type_size]
    out = q.dequantize_blocks(blocks)  # [n_blocks, block_size]
    if out.untyped_storage().data_ptr() == data.untyped_storage().data_ptr() and out.numel():
        out = out.clone()  # F32 decodes to a view of the input, which may be a read-only memmap
    return out.reshape(shape)  # [n_blocks, block_size] -> logical shape


def quantize_reference(values: np.ndarray, qtype) -> np.ndarray:
    """Quantize with gguf-py's numpy reference (slow, for writing test models).

    Returns exactly what `gguf.quants.quantize` does: float32/float16 arrays for F32/F16,
    otherwise uint8 `[..., bytes_per_row]`, ready for `GGUFWriter.add_tensor(raw_dtype=qtype)`.
    """
    import gguf.quants

    t = get(qtype).ggml_type
    try:
        return gguf.quants.quantize(np.asarray(values), t)
    except gguf.quants.QuantError as e:
        raise StrataError(str(e), f"rows must be a multiple of {get(t).block_size} values") from None
    except NotImplementedError:
        raise UnsupportedQuantType(
            f"gguf-py cannot quantize to {t.name}",
            "use one of F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0, MXFP4",
        ) from None
