"""Open a model file or directory: pick the architecture, build it, attach the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from strata.errors import BadModelFile, StrataError
from strata.formats.checkpoint import open_config
from strata.models import registry
from strata.models.weights import WeightLoader
from strata.tiers.ngram_table import open_table


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    config: object
    arch: ModuleType  # the format module (strata.formats.<arch>)
    tokenizer: object | None
    source: object  # GGUFSource or HFSource, for inspection and the tiers
    metadata: dict


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False) -> LoadedModel:
    from strata.runtime.progress import tensor_bar

    arch, config, source, meta = open_config(path)
    seams = {"table_reader": open_table} if getattr(config, "ple_layers", ()) else {}  # an n-gram table (PLE)
    with tensor_bar(len(source.names()), progress) as advance:
        model = registry.model_class(arch.ARCH)(config, WeightLoader(source, dtype, on_tensor=advance), **seams).eval()
    return LoadedModel(model, model.config, arch, _tokenizer(Path(path), meta), source, meta)


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
