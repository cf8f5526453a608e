"""A disk-homed expert whose file stops being readable mid-run: one line naming the file, then recovery."""

import os

import pytest
import torch

from strata.errors import StrataError
from strata.tiers.store import DiskHome, ExpertFormat, FileReader, Part

SIZES = (4096, 4096, 8192)  # gate, up, down bytes of one expert
N_EXPERTS = 4


def _file(path) -> bytes:
    data = os.urandom(sum(SIZES) * N_EXPERTS)
    path.write_bytes(data)
    return data


def _home(path) -> DiskHome:
    offsets, start = [], 0
    for n in SIZES:  # each projection stacked over the experts, as a GGUF stores it
        offsets.append(start)
        start += n * N_EXPERTS
    fmt = ExpertFormat(tuple(Part(None, (1, n), n, off) for n, off in zip(SIZES, offsets)))
    return DiskHome({0: fmt}, FileReader(path), capacity=0, readers=2)


def _expected(data: bytes, e: int) -> list[bytes]:
    out, start = [], 0
    for n in SIZES:
        out.append(data[start + e * n:start + (e + 1) * n])
        start += n * N_EXPERTS
    return out


def test_a_truncated_file_is_one_line_naming_it_and_a_later_read_recovers(tmp_path):
    path = tmp_path / "model.gguf"
    data = _file(path)
    home = _home(path)
    try:
        got = [bytes(t.numpy()) for t in home.parts(0, 0)]
        assert got == _expected(data, 0)
        os.truncate(path, SIZES[0] * N_EXPERTS // 2)  # the file shrinks under the running engine
        with pytest.raises(StrataError) as err:
            home.parts(0, 3)
        message = str(err.value)
        assert str(path) in message and "\n" not in message and "--pin-experts ram" in message
        path.write_bytes(data)  # the file is back: the failed read is not cached as an error
        assert [bytes(t.numpy()) for t in home.parts(0, 3)] == _expected(data, 3)
    finally:
        home.close()
