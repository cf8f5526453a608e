"""libc's madvise, for the two places that fault memory in ahead of use: a mapped GGUF file's pages
(`GGUFFile.populate`) and the disk home's RAM-cache arena (`tiers.arena`)."""

from __future__ import annotations

import ctypes
import sys

MADV_POPULATE_READ = 22  # Linux 5.14+: fault the range in, readable, without touching it
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in, writable, without touching it


def madvise():
    """libc's madvise through ctypes (which releases the GIL during the call), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
