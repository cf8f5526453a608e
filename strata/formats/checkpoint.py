"""A model file or directory -> its architecture's format module, its `Config` and a weight source.

Nothing is loaded: the planner, `strata inspect`, the converter and the loader all start here.
"""

from __future__ import annotations

from pathlib import Path

from strata.errors import BadModelFile
from strata.formats import architectures, hf, validate
from strata.gguf.reader import GGUFFile
from strata.gguf.source import GGUFSource


def open_config(path: str | Path):
    """The architecture's format module, its hyper-parameters, and a weight source; nothing is loaded."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").exists():
        cfg = hf.read_config(path)
        validate.check_hf(cfg, hf.tensor_shapes(path), str(path / "config.json"))
        model_type = cfg.get("model_type", "?")
        arch = architectures.by_hf_model_type(model_type if isinstance(model_type, str) else repr(model_type))
        config = _build_config(arch.Config.from_hf, cfg, str(path / "config.json"))
        source = hf.HFSource(path, getattr(arch, "HF_TENSOR_NAMES", ()),
                             getattr(arch, "sanitize_hf", None), config)
        if hasattr(arch, "config_with_weights"):  # what config.json leaves out (an MTP layer)
            config = source.config = arch.config_with_weights(config, source.names())
        return arch, config, source, cfg
    file = GGUFFile(path)
    arch = architectures.by_arch(file.arch)
    validate.check_gguf(file.metadata, file.arch, {n: t.shape for n, t in file.tensors.items()}, str(path))
    config = _build_config(arch.Config.from_gguf, file.metadata, str(path))
    return arch, config, GGUFSource(file), file.metadata


def _build_config(factory, meta: dict, where: str):
    try:
        config = factory(meta)
    except KeyError as e:
        raise BadModelFile(f"{where}: required metadata key {e.args[0]!r} is missing",
                           "re-convert the model with a current converter") from None
    except (TypeError, ValueError, ZeroDivisionError, IndexError, OverflowError, AttributeError) as e:
        # what the validation pass has no rule for: still one line, naming what broke
        raise BadModelFile(f"{where}: metadata the reader cannot use ({type(e).__name__}: {e})",
                           "the file is corrupt or from a broken converter; re-convert the model") from None
    validate.check_config(config, where)
    return config
