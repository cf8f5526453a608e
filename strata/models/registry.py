"""Architectures by GGUF `general.architecture` string, found by scanning this package.

Adding an architecture is adding one module that defines ARCH, HF_MODEL_TYPES, Config
and Model; nothing central is edited.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from types import ModuleType

import strata.models
from strata.errors import StrataError


@cache
def architectures() -> dict[str, ModuleType]:
    found = {}
    for info in pkgutil.iter_modules(strata.models.__path__):
        module = importlib.import_module(f"strata.models.{info.name}")
        if hasattr(module, "ARCH") and hasattr(module, "Model"):
            found[module.ARCH] = module
    return found


def by_arch(arch: str) -> ModuleType:
    archs = architectures()
    if arch not in archs:
        raise StrataError(f"unknown architecture {arch!r}",
                          f"supported: {', '.join(sorted(archs))}")
    return archs[arch]


def by_hf_model_type(model_type: str) -> ModuleType:
    for module in architectures().values():
        if model_type in module.HF_MODEL_TYPES:
            return module
    known = sorted(t for m in architectures().values() for t in m.HF_MODEL_TYPES)
    raise StrataError(f"unknown model_type {model_type!r} in config.json", f"supported: {', '.join(known)}")
