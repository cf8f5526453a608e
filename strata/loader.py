"""Open a model file or directory: pick the architecture, build it, attach the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from strata.errors import BadModelFile, StrataError
from strata.formats import architectures, hf
from strata.gguf.reader import GGUFFile
from strata.gguf.source import GGUFSource
from strata.models import registry
from strata.models.weights import WeightLoader


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    config: object
    arch: ModuleType  # the format module (strata.formats.<arch>)
    tokenizer: object | None
    source: object  # GGUFSource or HFSource, for inspection and the tiers
    metadata: dict


def open_config(path: str | Path):
    """The architecture's format module, its hyper-parameters, and a weight source; nothing is loaded."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").exists():
        cfg = hf.read_config(path)
        arch = architectures.by_hf_model_type(cfg.get("model_type", "?"))
        config = _build_config(arch.Config.from_hf, cfg, str(path / "config.json"))
        source = hf.HFSource(path, getattr(arch, "HF_TENSOR_NAMES", ()),
                             getattr(arch, "sanitize_hf", None), config)
        if hasattr(arch, "config_with_weights"):  # what config.json leaves out (an MTP layer)
            config = source.config = arch.config_with_weights(config, source.names())
        return arch, config, source, cfg
    file = GGUFFile(path)
    arch = architectures.by_arch(file.arch)
    config = _build_config(arch.Config.from_gguf, file.metadata, str(path))
    return arch, config, GGUFSource(file), file.metadata


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False) -> LoadedModel:
    from strata.runtime.progress import tensor_bar

    arch, config, source, meta = open_config(path)
    with tensor_bar(len(source.names()), progress) as advance:
        model = registry.model_class(arch.ARCH)(config, WeightLoader(source, dtype, on_tensor=advance)).eval()
    return LoadedModel(model, model.config, arch, _tokenizer(Path(path), meta), source, meta)


def _build_config(factory, meta: dict, where: str):
    try:
        return factory(meta)
    except KeyError as e:
        raise BadModelFile(f"{where}: required metadata key {e.args[0]!r} is missing",
                           "re-convert the model with a current converter") from None


def _tokenizer(path: Path, meta: dict):
    if path.is_dir() and not (path / "tokenizer.json").exists():
        return None
    if not path.is_dir() and "tokenizer.ggml.tokens" not in meta:
        return None
    from strata.formats.tokenizer import Tokenizer

    if path.is_dir():
        return Tokenizer.from_dir(path)
    try:
        return Tokenizer.from_gguf_metadata(meta)
    except StrataError:
        raise
    except Exception as e:  # a tokenizer the converter wrote in a shape we do not know
        raise BadModelFile(f"cannot build the tokenizer from GGUF metadata ({e})") from None
