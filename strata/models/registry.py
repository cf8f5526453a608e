"""The model class of each architecture, by GGUF `general.architecture` string.

An architecture is two modules: its format (`strata.formats.<arch>`: Config, names, metadata)
and its model (`strata.models.<arch>`: the modules); both are listed here and in
`strata.formats.architectures`.
"""

from __future__ import annotations

from torch import nn

from strata.formats.architectures import by_arch
from strata.models import llama, qwen3moe, qwen3next, qwen4exp

MODELS: dict[str, type[nn.Module]] = {"llama": llama.Model, "qwen3moe": qwen3moe.Model,
                                      "qwen3next": qwen3next.Model, "qwen4exp": qwen4exp.Model}


def model_class(arch: str) -> type[nn.Module]:
    """The model of `arch`; an unknown one is refused naming the supported ones."""
    by_arch(arch)
    return MODELS[arch]
