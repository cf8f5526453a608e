"""The supported architectures' formats, by GGUF `general.architecture` and by HF `model_type`.

Each format module (`strata.formats.<arch>`) defines ARCH, HF_MODEL_TYPES, `Config` (read
with `Config.from_gguf` / `Config.from_hf`) and `gguf_metadata`; HF checkpoints also need
HF_TENSOR_NAMES and `sanitize_hf`. The model built from a `Config` is `strata.models.registry`'s.
"""

from __future__ import annotations

from types import ModuleType

from strata.errors import StrataError
from strata.formats import llama, qwen3moe, qwen3next, qwen4exp

FORMATS: dict[str, ModuleType] = {m.ARCH: m for m in (llama, qwen3moe, qwen3next, qwen4exp)}


def by_arch(arch: str) -> ModuleType:
    if arch not in FORMATS:
        raise StrataError(f"unknown architecture {arch!r}", f"supported: {', '.join(sorted(FORMATS))}")
    return FORMATS[arch]


def by_hf_model_type(model_type: str) -> ModuleType:
    for module in FORMATS.values():
        if model_type in module.HF_MODEL_TYPES:
            return module
    known = sorted(t for m in FORMATS.values() for t in m.HF_MODEL_TYPES)
    raise StrataError(f"unknown model_type {model_type!r} in config.json", f"supported: {', '.join(known)}")
