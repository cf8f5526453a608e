"""Strata: run Mixture-of-Experts models larger than GPU memory by placing weights in tiers."""

import os
import sys

# torch's OpenMP team waits for work passively (sleeping, not spinning) unless the user chose: Strata's
# CPU work runs in its own threads (the kernels' pool, the experts' CPU workers, the disk readers) beside
# the team, and on shared cores its spinning worker took them (an 8-token prompt of the full-size
# qwen4exp from disk: 13-42 s and 8-21 s of CPU with spinning, 7-13 s and 6-9 s without, load 6-8).
# libgomp reads this once, when torch is imported: a program that imports torch first keeps its setting.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from strata.errors import StrataError  # noqa: E402

__all__ = ["load", "StrataError"]
__version__ = "0.1.0"


def load(path, **options):
    """Open a GGUF file or a Hugging Face model directory and return an `Engine`.

    The cyclic garbage collector is off while the model is built: loading makes ~200,000 objects
    that all live on, and its collections of them took 0.3-0.5 s of the full-size qwen4exp's load
    (three full passes); reference counting still frees everything else."""
    import gc

    from strata.runtime.engine import load as _load

    collecting = gc.isenabled()
    gc.disable()
    try:
        return _load(path, **options)
    finally:
        if collecting:
            gc.enable()
