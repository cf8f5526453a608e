"""bench/bench_scale.py's --write-in-turn: its values and the file it may delete (no run here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tiny import write_tiny_llama

_PATH = Path(__file__).resolve().parent.parent / "bench" / "bench_scale.py"
_spec = importlib.util.spec_from_file_location("bench_scale", _PATH)
bench_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_scale)


def test_a_bad_skew_list_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench_scale.main(["--model", str(tmp_path / "m.gguf"), "--write-in-turn", "0,a"])
    assert e.value.code == 2 and "'0,a' is not a comma-separated list" in capsys.readouterr().err


def test_write_in_turn_never_deletes_a_file_strata_synth_did_not_write(tmp_path):
    model = write_tiny_llama(tmp_path / "mine.gguf")
    with pytest.raises(SystemExit, match="strata synth did not write"):
        bench_scale.write_synth(model, "qwen4exp", 4, "IQ2_XS", 0.0)
    assert model.exists()
    other = tmp_path / "notes.txt"
    other.write_text("not a model")
    with pytest.raises(SystemExit, match="strata synth did not write"):
        bench_scale.write_synth(other, "qwen4exp", 4, "IQ2_XS", 0.0)
    assert other.read_text() == "not a model"


def test_a_file_strata_synth_wrote_is_recognised(tmp_path):
    from strata import synth

    path = synth.write(tmp_path / "s.gguf", like_name="qwen3-30b-a3b", layers=1, vocab=300, experts=4, sparse=True)
    assert bench_scale._synth_name(path).startswith("synth-")
