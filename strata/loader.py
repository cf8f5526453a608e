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

    where = path / "tokenizer.json" if path.is_dir() else f"{path}: GGUF tokenizer metadata"
    try:
        return Tokenizer.from_dir(path) if path.is_dir() else Tokenizer.from_gguf_metadata(meta)
    except StrataError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - the tokenizers library's PanicException is a BaseException
        raise BadModelFile(f"{where}: cannot build the tokenizer ({type(e).__name__}: {str(e)[:200]})",
                           "the tokenizer data is corrupt; re-convert or re-download the model") from None
