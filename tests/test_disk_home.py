"""A disk home's reads: computed in the order they land, and each use counted once as what it was."""

import os
import threading

from strata.tiers.store import DIRECT_MIN, DiskHome, ExpertFormat, FileReader, Part, read_slack

SIZES = (4096, 4096, 8192)  # gate, up, down bytes of one expert
N_EXPERTS = 6


def _home(path, capacity, readers=2) -> DiskHome:
    path.write_bytes(os.urandom(sum(SIZES) * N_EXPERTS))
    offsets, start = [], 0
    for n in SIZES:
        offsets.append(start)
        start += n * N_EXPERTS
    fmt = ExpertFormat(tuple(Part(None, (1, n), n, off) for n, off in zip(SIZES, offsets)))
    return DiskHome({0: fmt}, FileReader(path), capacity=capacity, readers=readers)


def test_arrival_yields_reads_as_they_land_and_uses_count_as_misses_hits_and_reads_ahead(tmp_path):
    home = _home(tmp_path / "m.gguf", capacity=2**20)  # room for all: nothing is evicted
    gate = threading.Event()
    read = home._read
    home._read = lambda layer, e: (gate.wait(5) if e == 1 else None, read(layer, e))[1]  # expert 1 lands last
    try:
        home.request(0, [4], ahead=True)  # a prediction
        home.request(0, [1, 2, 3, 4])  # the layer's own misses (4 already being read ahead)
        order = home.arrival(0, [1, 2, 3, 4])
        first = [next(order) for _ in range(3)]
        assert sorted(first) == [2, 3, 4]  # nothing waits for the slow read of expert 1
        gate.set()
        assert next(order) == 1
        for e in (1, 2, 3, 4):
            home.parts(0, e)
        assert (home.misses, home.hits, home.ahead_used, home.read_ahead) == (3, 0, 1, 1)
        for e in (1, 2):
            home.parts(0, e)  # cached now
        assert (home.misses, home.hits, home.ahead_used) == (3, 2, 1)
        assert home.stats()["disk_reads"] == 4
    finally:
        gate.set()
        home.close()


def test_a_large_span_is_read_straight_into_its_own_buffer(tmp_path):
    path = tmp_path / "big.bin"
    data = os.urandom(3 * DIRECT_MIN)
    path.write_bytes(data)
    reader = FileReader(path)
    try:
        for offset, n in ((0, DIRECT_MIN), (4097, DIRECT_MIN + 5), (123, 2 * DIRECT_MIN)):
            got = reader.read_span(offset, n)
            assert bytes(got.numpy()) == data[offset:offset + n]
            if reader.direct:  # a view of its aligned buffer, which holds at most 3 pages more
                assert got.untyped_storage().nbytes() - n <= read_slack(n) // 3
        assert reader.bytes_read == 3 * DIRECT_MIN + 5 + DIRECT_MIN
    finally:
        reader.close()
