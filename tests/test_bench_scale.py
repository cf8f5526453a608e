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


def test_expert_spans_are_each_experts_three_ranges_as_the_disk_home_reads_them(tmp_path):
    from gguf import GGUFReader

    from strata import synth

    path = synth.write(tmp_path / "s.gguf", like_name="qwen3-30b-a3b", layers=2, vocab=300, experts=4, sparse=True)
    spans = bench_scale.expert_spans(path)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    assert len(spans) == 2 * 4
    gate = tensors["blk.1.ffn_gate_exps.weight"]
    per = int(gate.n_bytes) // 4
    assert spans[4 + 3][0] == (int(gate.data_offset) + 3 * per, per)  # layer 1, expert 3's gate
    down = tensors["blk.0.ffn_down_exps.weight"]
    assert spans[3][2][0] + spans[3][2][1] == int(down.data_offset) + int(down.n_bytes)  # the last expert ends the tensor


def test_the_disk_limit_is_never_below_what_the_runs_own_reads_got():
    r = {"disk_before": 0.3e9, "disk_after": 0.4e9, "prefill_device_bytes": 1e9, "prefill_busy_s": 2.0,
         "decode_device_bytes": 8e9, "decode_busy_s": 10.0}
    bw, where = bench_scale.disk_limit(r)
    assert (bw, where) == (0.8e9, "decode's reads")  # the probes read the disk low: the run's reads decide
    decode_s = 12.0  # the decode's wall time is never shorter than the time a read was in flight
    assert (r["decode_device_bytes"] / decode_s) / bw <= 1.0
    r.update(decode_busy_s=0.0, decode_device_bytes=0)
    assert bench_scale.disk_limit(r) == (0.5e9, "prefill's reads")


def test_the_prefills_own_disk_rate_ignores_what_decode_found_later():
    """The second time-to-first-token ratio uses the disk as the prompt found it: the probe just
    before it or its own reads, the better; never decode's reads, which came later."""
    r = {"disk_before": 0.3e9, "disk_after": 0.9e9, "prefill_device_bytes": 1e9, "prefill_busy_s": 4.0,
         "decode_device_bytes": 8e9, "decode_busy_s": 10.0}
    assert bench_scale.prefill_disk(r) == 0.3e9  # its reads got 0.25 GB/s: the probe says the disk gave more
    r["prefill_busy_s"] = 2.0
    assert bench_scale.prefill_disk(r) == 0.5e9
    assert bench_scale.disk_limit(r)[0] == 0.9e9  # the strict limit still takes the best of the four
