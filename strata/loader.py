"""Open a model file or directory: pick the architecture, build it, attach the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from strata.errors import BadModelFile, StrataError
from strata.formats.checkpoint import open_config
from strata.models import registry
from strata.models.seams import InPlace, Resident, Seams
from strata.models.weights import WeightLoader
from strata.tiers.kv_tiers import TieredKV
from strata.tiers.ngram_table import open_table
from strata.tiers.placement import BlockPlacement
from strata.tiers.runtime import TieredProvider, install as install_tiers


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    config: object
    arch: ModuleType  # the format module (strata.formats.<arch>)
    tokenizer: object | None
    source: object  # GGUFSource or HFSource, for inspection and the tiers
    metadata: dict


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False,
               seams: Seams | None = None, on_open=None, opened=None) -> LoadedModel:
    """The model built with `seams` (`strata.models.seams`: experts provider, KV-cache factory, table
    reader, placement); by default all resident, the n-gram table read by the tiers' `open_table`.
    `on_open(source)` runs once the file is open, before the model is built; `opened`: what
    `open_config(path)` returned, when the caller has opened it already."""
    from strata.runtime.progress import tensor_bar

    seams = seams or Seams(table_reader=open_table)
    arch, config, source, meta = opened or open_config(path)
    if on_open is not None:
        on_open(source)
    with tensor_bar(len(source.names()), progress) as advance:
        model = registry.model_class(arch.ARCH)(config, WeightLoader(source, dtype, on_tensor=advance), seams).eval()
    return LoadedModel(model, model.config, arch, _tokenizer(Path(path), meta), source, meta)


def load_with_tiers(path: str | Path, options) -> tuple[LoadedModel, object | None, object | None]:
    """The model built with the seams `options` (an `EngineOptions`) ask for, then those completed
    over it: (loaded, the expert tiers or expert-parallel runtime or None, --kv-device's
    `KVTierConfig` or None). Without tier options, for a file that fits in RAM, the model is the
    plain resident one."""
    from strata.tiers.auto import exceeds_ram
    from strata.tiers.options import tiers_requested

    dtype = getattr(torch, options.dtype)
    opened = open_config(path)
    tiered, tiers = False, None
    try:  # the tiers read the dense weights ahead from the moment the file is open
        experts, placement = Resident(), InPlace()
        if options.expert_parallel:  # imported here: torch.distributed is slow to import and rarely used
            from strata.tiers.expert_parallel.rank0 import ParallelProvider, install as install_parallel

            experts, placement = ParallelProvider(), BlockPlacement()
        elif tiers_requested(options) or exceeds_ram(opened[2]):  # no --pin-experts: the plan picks the home
            experts, placement = TieredProvider(), BlockPlacement()
        kv = TieredKV(options.kv_device_budget, dtype) if options.kv_device_budget is not None else None
        tiered = isinstance(experts, TieredProvider)
        loaded = load_model(path, dtype, options.progress, Seams(experts, kv, open_table, placement),
                            experts.read_ahead if tiered else None if options.expert_parallel else _populate, opened)
        if options.expert_parallel:
            tiers = install_parallel(loaded, options)
        elif tiered:
            from strata.runtime.progress import byte_bar

            tiers = install_tiers(loaded, options, lambda total: byte_bar(total, options.progress))
        kv_config = kv.configure(loaded.model) if kv is not None else None  # KV after the tiers' placement
    except BaseException:
        if tiers is not None:
            tiers.close()
        if tiered:
            experts.close_readahead()
        _close(opened[2])
        raise
    return loaded, tiers, kv_config


def _close(source) -> None:
    """A source whose load failed lets go of its file (`close`: the mapping or handles), so a caller
    that keeps the error (a server retrying, a test) does not keep the file mapped with it."""
    close = getattr(source, "close", None)
    if close is not None:
        close()


def _populate(source) -> None:
    """A file the plain path maps whole (it fits in RAM): its pages mapped in before the model is
    built, so no decode token faults them in (`GGUFFile.populate`; another source: nothing)."""
    populate = getattr(source, "populate", None)
    if populate is not None:
        populate()


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
