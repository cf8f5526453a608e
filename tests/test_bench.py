"""`strata bench` produces its report (JSON, Markdown, PNG) on a tiny model: a smoke run, no timing."""

from __future__ import annotations

import json

from strata.cli import main
from tiny import write_tiny_llama


def test_bench_quick_writes_every_regime(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", context_length=256)
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model), "--out", str(out), "--quick"]) == 0
    r = json.loads((out / "bench.json").read_text())
    assert [c["page_cache"].split()[0] for c in r["cold_start"]] == ["dropped", "warm"]
    assert r["serial_warm"]["runs"] == 2 and r["serial_warm"]["median_tps"] > 0
    assert [c["concurrency"] for c in r["concurrency"]] == [1, 2]
    assert all(c["aggregate_tps"] > 0 and c["ttft_p95_s"] >= c["ttft_p50_s"] for c in r["concurrency"])
    assert r["long_output"]["tokens"] == 64 and len(r["long_output"]["tps_per_window"]) >= 7
    assert r["prefill"][0]["tokens"] == 64 and r["prefill"][0]["tps"] > 0
    md = (out / "bench.md").read_text()
    assert "| serial warm |" in md and "| concurrency 2 |" in md and "cold start" in md
    assert (out / "bench.png").stat().st_size > 1000
    assert "| serial warm |" in capsys.readouterr().out


def test_bench_reports_hit_rates_when_tiers_are_on(tmp_path, capsys):
    model = write_tiny_llama(tmp_path / "tiny.gguf", context_length=256)
    out = tmp_path / "report"
    assert main(["bench", "--model", str(model), "--out", str(out), "--quick", "--experts-cache", "25%"]) == 0
    r = json.loads((out / "bench.json").read_text())
    rates = [r["serial_warm"]["hit_rate"], r["long_output"]["hit_rate"]] + [c["hit_rate"] for c in r["concurrency"]]
    assert all(0.0 <= x <= 1.0 for x in rates), rates
