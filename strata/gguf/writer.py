"""Write GGUF files in llama.cpp's layout (used by the converter, the demo trainer and synth)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import gguf
import numpy as np
import torch

from strata import quant

_NP_FLOAT = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
_NP_VALUE_TYPE = {np.dtype(np.uint64): gguf.GGUFValueType.UINT64, np.dtype(np.int64): gguf.GGUFValueType.INT64,
                  np.dtype(np.uint32): gguf.GGUFValueType.UINT32, np.dtype(np.int32): gguf.GGUFValueType.INT32,
                  np.dtype(np.float32): gguf.GGUFValueType.FLOAT32}


def _value_type(value) -> gguf.GGUFValueType:
    if isinstance(value, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(value, int):
        return gguf.GGUFValueType.UINT32 if 0 <= value < 2**32 else gguf.GGUFValueType.INT64
    if isinstance(value, float):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(value, str):
        return gguf.GGUFValueType.STRING
    return gguf.GGUFValueType.ARRAY


def write_gguf(path: str | Path, arch: str, metadata: dict,
               tensors: Iterable[tuple[str, torch.Tensor, gguf.GGMLQuantizationType]]) -> Path:
    """metadata: GGUF keys -> python values; tensors: (name, float tensor, type to store)."""
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, np.ndarray):  # an explicit element type, e.g. uint64 hash constants
            writer.add_key_value(key, value.tolist(), gguf.GGUFValueType.ARRAY,
                                 sub_type=_NP_VALUE_TYPE[value.dtype])
        elif isinstance(value, (list, tuple)):
            sub = _value_type(value[0]) if value else gguf.GGUFValueType.INT32
            if sub == gguf.GGUFValueType.UINT32:
                sub = gguf.GGUFValueType.INT32
            writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            writer.add_key_value(key, value, _value_type(value))
    for name, tensor, qtype in tensors:
        array = tensor.detach().float().numpy()
        if qtype in _NP_FLOAT:
            writer.add_tensor(name, array.astype(_NP_FLOAT[qtype]))
        elif qtype == gguf.GGMLQuantizationType.BF16:
            bits = torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy()
            # uint8 data: gguf derives the logical shape from the byte shape
            writer.add_tensor(name, bits.view(np.uint8).reshape(*array.shape[:-1], -1), raw_dtype=qtype)
        else:
            data = quant.quantize_reference(array, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def decoder_metadata(arch: str, c, **extra) -> dict:
    """The GGUF keys every decoder-only architecture shares, from its Config."""
    meta = {
        f"{arch}.vocab_size": c.vocab_size,
        f"{arch}.block_count": c.n_layers,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.context_length": c.context_length,
        f"{arch}.attention.head_count": c.n_heads,
        f"{arch}.attention.head_count_kv": c.n_kv_heads,
        f"{arch}.attention.key_length": c.head_dim,
        f"{arch}.attention.value_length": c.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.rms_eps),
        f"{arch}.rope.freq_base": float(c.rope.theta),
        f"{arch}.rope.dimension_count": c.rope.dim,
    }
    if c.rope.scaling in ("linear", "yarn"):
        meta[f"{arch}.rope.scaling.type"] = c.rope.scaling
        meta[f"{arch}.rope.scaling.factor"] = float(c.rope.factor)
        meta[f"{arch}.rope.scaling.original_context_length"] = c.rope.original_context
    meta.update({f"{arch}.{k}": v for k, v in extra.items()})
    return meta
