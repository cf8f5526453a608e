"""Strata: run Mixture-of-Experts models larger than GPU memory by placing weights in tiers."""

from strata.errors import StrataError

__all__ = ["load", "StrataError"]
__version__ = "0.1.0"


def load(path, **options):
    """Open a GGUF file or a Hugging Face model directory and return an `Engine`."""
    from strata.runtime.engine import load as _load

    return _load(path, **options)
