"""`strata plan --auto` and `--pin-experts auto`: choices follow the budgets; predictions follow the trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import strata
from strata.cli import main
from strata.tiers.cache_sim import simulate
from strata.tiers.trace import load_trace

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


def test_prediction_replays_the_trace_at_the_planned_size(tmp_path, capsys):
    trace = tmp_path / "t.npz"
    e = strata.load(DEMO, trace_experts=str(trace), experts_cache="0")
    e.generate(e.tokenizer.encode("def main():\n    return 0\n"), 24, stop_at_eos=False)
    e.close()
    p = plan_json(capsys, "--pin-experts", "ram", "--experts-cache", "30%", "--trace", str(trace))
    frac = p["slots"] / p["n_experts"]
    want = simulate(load_trace(trace), ["adaptive"], [frac])["sizes"][0]["hit_rate"]
    assert p["prediction"]["hit_rate"] == pytest.approx(want["adaptive"])
    assert p["prediction"]["min_hit_rate"] == pytest.approx(want["min"])
    assert want["min"] >= want["adaptive"]


def test_pin_experts_auto_loads_and_matches_the_resident_run():
    ids = strata.load(DEMO).tokenizer.encode("import os\n")
    plain = strata.load(DEMO).generate(ids, 12, stop_at_eos=False)
    tiered = strata.load(DEMO, pin_experts="auto", experts_cache="30%", ram_memory="23M")
    assert tiered.generate(ids, 12, stop_at_eos=False) == plain
    assert tiered.tiers.stats()["plan"]["expert_homes"] == {"disk": moe_blocks()}
