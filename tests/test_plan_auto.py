"""`strata plan --auto` and `--pin-experts auto`: choices follow the budgets; predictions follow the trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import strata
from strata.cli import main

DEMO = Path(strata.__file__).parent / "demo" / "strata-demo.gguf"
pytestmark = pytest.mark.skipif(not DEMO.exists(), reason="demo model missing")


def moe_blocks() -> int:
    """Blocks with experts: every block of the demo, its MTP block included."""
    from strata.gguf.reader import GGUFFile

    file = GGUFFile(DEMO)
    return file.metadata[f"{file.arch}.block_count"]


def plan_json(capsys, *flags) -> dict:
    assert main(["plan", "--model", str(DEMO), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_auto_pins_experts_in_ram_when_they_fit(capsys):
    p = plan_json(capsys, "--auto", "--ram-memory", "1G")
    assert p["expert_homes"] == {"ram": moe_blocks()}
    assert p["auto"]["cpu_threads"] >= 1 and p["auto"]["free_disk"] > 0
    import torch

    # auto fills a CUDA device; without one it allocates no stand-in (that would copy RAM into RAM)
    assert p["slots"] == (p["n_experts"] if torch.cuda.is_available() else 0)


def test_auto_reads_experts_from_disk_when_ram_is_short(capsys):
    p = plan_json(capsys, "--auto", "--ram-memory", "20M")
    assert p["expert_homes"] == {"disk": moe_blocks()}
    assert "exceed" in p["auto"]["pin_experts_reason"]


def test_prediction_is_the_hit_rate_the_runtime_then_measures(tmp_path, capsys):
    """`strata plan --trace` predicts the hit rate of a run at the planned cache size; a run of the
    same prompt at that size (demand paging: prefetch off) measures it in its own counters."""
    trace = tmp_path / "t.npz"
    ids = strata.load(DEMO).tokenizer.encode("def main():\n    return 0\n")
    e = strata.load(DEMO, trace_experts=str(trace), experts_cache="0")
    e.generate(ids, 24, stop_at_eos=False)
    e.close()
    p = plan_json(capsys, "--pin-experts", "ram", "--experts-cache", "30%", "--trace", str(trace))
    run = strata.load(DEMO, pin_experts="ram", experts_cache="30%", prefetch=False)
    run.generate(ids, 24, stop_at_eos=False)
    measured = run.tiers.stats()["total"]
    run.close()
    assert measured["hits"] + measured["misses"] > 0
    assert p["prediction"]["hit_rate"] == pytest.approx(measured["hit_rate"])
    assert 1 >= p["prediction"]["min_hit_rate"] >= measured["hit_rate"]  # MIN bounds the policy


def test_pin_experts_auto_loads_and_matches_the_resident_run():
    ids = strata.load(DEMO).tokenizer.encode("import os\n")
    plain = strata.load(DEMO).generate(ids, 12, stop_at_eos=False)
    tiered = strata.load(DEMO, pin_experts="auto", experts_cache="30%", ram_memory="23M")
    assert tiered.generate(ids, 12, stop_at_eos=False) == plain
    assert tiered.tiers.stats()["plan"]["expert_homes"] == {"disk": moe_blocks()}
