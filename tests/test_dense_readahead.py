"""Dense weights read ahead from a cold file (strata/tiers/dense_readahead.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import strata
from strata import synth
from strata.formats.names import EXPERT_TENSOR
from strata.tiers import dense_readahead
from strata.tiers.dense_readahead import DenseReadahead, dense_spans


def test_spans_follow_the_forward_block_by_block_and_the_head_comes_last():
    t = {"output.weight": SimpleNamespace(offset=0, n_bytes=100),  # first in the file, used last
         "blk.10.a": SimpleNamespace(offset=200, n_bytes=50),
         "blk.2.b": SimpleNamespace(offset=5000, n_bytes=10),
         "blk.2.a": SimpleNamespace(offset=4000, n_bytes=1000),  # ends where blk.2.b starts: merged
         "blk.3.a": SimpleNamespace(offset=2**24, n_bytes=10)}
    assert dense_spans(t, set(t)) == [(4000, 1010), (2**24, 10), (200, 50), (0, 100)]
    assert dense_spans(t, {"blk.3.a"}) == [(2**24, 10)]
    gap = dense_readahead.MERGE_GAP + 1
    far = {"blk.0.a": SimpleNamespace(offset=0, n_bytes=1), "blk.0.b": SimpleNamespace(offset=1 + gap, n_bytes=1)}
    assert dense_spans(far, set(far)) == [(0, 1), (1 + gap, 1)]


def test_every_span_is_asked_for_in_order_in_chunks(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * 4096)
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, o, n, advice: asked.append((o, n, advice)))
    monkeypatch.setattr(dense_readahead, "CHUNK", 1000)
    ra = DenseReadahead(path, [(3000, 2500), (0, 100)])
    ra.close()
    w = os.POSIX_FADV_WILLNEED
    assert asked == [(3000, 1000, w), (4000, 1000, w), (5000, 500, w), (0, 100, w)]
    assert ra.requested == ra.total == 2600


def test_a_tiered_engine_reads_ahead_its_dense_weights_only(tmp_path):
    path = synth.write(tmp_path / "m.gguf", "qwen3-30b-a3b", 1, "Q4_K_M", vocab=512, experts=8, sparse=True)
    engine = strata.load(path, ram_memory="2G", pin_experts="disk", experts_cache="0", cpu_threads=1)
    try:
        ra = engine.tiers.readahead
        tensors = engine.loaded.source.file.tensors
        dense = [n for n in tensors if not EXPERT_TENSOR.match(n) and n != "token_embd.weight"]
        assert ra is not None and ra.total == sum(tensors[n].n_bytes for n in dense)
        inside = lambda info: any(o <= info.offset and info.offset + info.n_bytes <= o + n for o, n in ra.spans)  # noqa: E731
        assert all(inside(tensors[n]) for n in dense)
        assert not any(inside(tensors[n]) for n in tensors if n not in dense)
        assert len(engine.generate([1, 2, 3], 2, stop_at_eos=False)) == 2
    finally:
        engine.close()
    assert ra._thread is None


def _recording(monkeypatch, events):
    """DenseReadahead, model building and the tiers' install, each recorded as it happens."""
    from strata import loader
    from strata.models import registry
    from strata.tiers import runtime

    made = []

    class Recorded(DenseReadahead):
        def __init__(self, *a, **k):
            events.append("readahead")
            made.append(self)
            super().__init__(*a, **k)

    model_class, install = registry.model_class, loader.install_tiers

    def building(arch):
        cls = model_class(arch)
        return lambda *a, **k: (events.append("build"), cls(*a, **k))[1]
    monkeypatch.setattr(runtime, "DenseReadahead", Recorded)
    monkeypatch.setattr(registry, "model_class", building)
    monkeypatch.setattr(loader, "install_tiers", lambda *a, **k: (events.append("install"), install(*a, **k))[1])
    return made


def test_the_read_ahead_starts_as_the_file_opens_before_the_model_is_built(tmp_path, monkeypatch):
    path = synth.write(tmp_path / "m.gguf", "qwen3-30b-a3b", 1, "Q4_K_M", vocab=512, experts=8, sparse=True)
    events = []
    made = _recording(monkeypatch, events)
    engine = strata.load(path, ram_memory="2G", pin_experts="disk", experts_cache="0", cpu_threads=1)
    try:
        assert events == ["readahead", "build", "install"]  # one read ahead, started first, kept by the tiers
        assert engine.tiers.readahead is made[0]
        assert len(engine.generate([1, 2, 3], 2, stop_at_eos=False)) == 2
    finally:
        engine.close()
    assert made[0]._thread is None


def test_a_load_that_fails_after_the_file_opened_stops_its_read_ahead(tmp_path, monkeypatch):
    import pytest

    from strata.errors import StrataError

    path = synth.write(tmp_path / "m.gguf", "qwen3-30b-a3b", 1, "Q4_K_M", vocab=512, experts=8, sparse=True)
    events = []
    made = _recording(monkeypatch, events)
    with pytest.raises(StrataError):  # a budget far below the dense weights: refused by the plan
        strata.load(path, ram_memory="1M", pin_experts="disk", experts_cache="0", cpu_threads=1)
    assert events[:2] == ["readahead", "build"] and made and all(ra._thread is None for ra in made)


def test_an_install_that_fails_after_taking_the_early_read_ahead_stops_it(tmp_path, monkeypatch):
    """install takes the read ahead started as the file opened; failing after that (here: the
    install's own spans cannot be worked out) still stops it."""
    import pytest

    from strata.tiers import runtime

    path = synth.write(tmp_path / "m.gguf", "qwen3-30b-a3b", 1, "Q4_K_M", vocab=512, experts=8, sparse=True)
    events = []
    made = _recording(monkeypatch, events)
    spans = runtime.dense_spans
    calls = []

    def second_fails(*a):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("install's spans")
        return spans(*a)
    monkeypatch.setattr(runtime, "dense_spans", second_fails)
    with pytest.raises(RuntimeError, match="install's spans"):
        strata.load(path, ram_memory="2G", pin_experts="disk", experts_cache="0", cpu_threads=1)
    assert events == ["readahead", "build", "install"] and len(made) == 1 and made[0]._thread is None
