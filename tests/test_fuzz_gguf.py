"""A short run of bench/fuzz_gguf.py: mutated GGUF files end in a clean error or a run, never worse."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parent.parent / "bench" / "fuzz_gguf.py"
_spec = importlib.util.spec_from_file_location("fuzz_gguf", _PATH)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_gguf"] = fuzz
_spec.loader.exec_module(fuzz)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return fuzz.write_seeds(tmp_path_factory.mktemp("fuzz") / "seeds")


def test_seeds_run_and_encode_round_trips(seeds, tmp_path):
    for seed in seeds:  # the fuzzer's own encoder reproduces the file, so mutations start from a valid one
        raw = fuzz.encode(fuzz.read_doc(seed))
        assert raw == seed.read_bytes()[:len(raw)] and len(raw) == seed.stat().st_size
    results = fuzz.run_cases(seeds, len(seeds), 0, 1, 60, 2 << 30, tmp_path, mutations=False)
    assert [r.outcome for r in results] == ["ran"] * len(seeds), [r.detail for r in results]


def test_300_mutated_files_give_no_traceback_hang_crash_or_memory(seeds, tmp_path):
    results = fuzz.run_cases(seeds, 300, 0, 2, 30, 2 << 30, tmp_path)
    bad = [(r.case, r.outcome, r.mutations, r.detail) for r in results if r.outcome not in ("clean", "ran")]
    assert len(results) == 300 and not bad, "\n".join(map(str, bad[:10]))
    assert sum(r.outcome == "clean" for r in results) > 100  # the mutations do break files
    assert sum(r.outcome == "ran" for r in results) > 5  # ... and not every one of them


def test_a_clean_error_is_told_from_a_traceback(tmp_path):
    log = tmp_path / "log"
    log.write_text("strata run: error: x.gguf: bad (fix it)\n")
    assert fuzz._classify(2 << 8, log)[0] == "clean"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nKeyError: 3\n")
    assert fuzz._classify(fuzz.EXIT_TRACEBACK << 8, log)[0] == "traceback"
    log.write_text("strata run: error: no newline")
    assert fuzz._classify(2 << 8, log)[0] == "traceback"
    assert fuzz._classify(None, log)[0] == "hang" and fuzz._classify(9, log)[0] == "crash"
