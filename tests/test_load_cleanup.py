"""A load that fails lets go of what it opened: the file's mapping, the disk readers, their file."""

from __future__ import annotations

import gc
import threading

import pytest

import strata
from strata import loader, synth
from strata.errors import StrataError
from strata.tiers import runtime


def _model(tmp_path):
    return synth.write(tmp_path / "m.gguf", "qwen3-30b-a3b", 1, "Q4_K_M", vocab=512, experts=8, sparse=True)


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return str(path) in f.read()


def _readers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("strata-read-")]


def _recording_opens(monkeypatch) -> list:
    opened = []
    real = loader.open_config

    def open_config(path):
        opened.append(real(path))
        return opened[-1]
    monkeypatch.setattr(loader, "open_config", open_config)
    return opened


def test_a_refused_plan_lets_go_of_the_files_mapping(tmp_path, monkeypatch):
    path = _model(tmp_path)
    opened = _recording_opens(monkeypatch)
    with pytest.raises(StrataError):  # a budget far below the dense weights: refused by the plan
        strata.load(path, ram_memory="1M", pin_experts="disk", experts_cache="0", cpu_threads=1)
    gc.collect()
    source = opened[0][2]  # still referenced here, as a caller keeping the error would
    assert source.file._map is None and not _mapped(path)


def _recording_readers(monkeypatch) -> list:
    made = []

    class Recorded(runtime.FileReader):
        def __init__(self, path):
            super().__init__(path)
            made.append(self)
    monkeypatch.setattr(runtime, "FileReader", Recorded)
    return made


def test_an_install_that_fails_after_the_disk_home_is_built_stops_its_readers(tmp_path, monkeypatch):
    path = _model(tmp_path)
    made = _recording_readers(monkeypatch)
    opened = _recording_opens(monkeypatch)

    def no_lane(*a, **k):
        assert _readers_alive(), "the disk home's readers run by now"
        raise RuntimeError("no lane")
    monkeypatch.setattr(runtime, "CpuLane", no_lane)
    with pytest.raises(RuntimeError, match="no lane"):
        strata.load(path, ram_memory="2G", pin_experts="disk", experts_cache="0", cpu_threads=1)
    assert not _readers_alive() and len(made) == 1 and made[0].fd == -1
    gc.collect()
    assert opened[0][2].file._map is None and not _mapped(path)


def test_an_install_that_fails_after_the_runtime_is_built_closes_it(tmp_path, monkeypatch):
    path = _model(tmp_path)
    made = _recording_readers(monkeypatch)
    spans, calls = runtime.dense_spans, []

    def second_fails(*a):  # the first is the early read ahead's, as the file opens; the second install's
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("install's spans")
        return spans(*a)
    monkeypatch.setattr(runtime, "dense_spans", second_fails)
    with pytest.raises(RuntimeError, match="install's spans"):
        strata.load(path, ram_memory="2G", pin_experts="disk", experts_cache="0", cpu_threads=1)
    assert not _readers_alive() and len(made) == 1 and made[0].fd == -1
