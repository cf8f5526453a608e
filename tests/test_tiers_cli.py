"""`strata run` with tier flags: the plan applies, stats are printed and in --json, a trace is written."""

from __future__ import annotations

import json

import pytest

from strata.cli import main as cli_main
from strata.tiers.trace import load_trace
from tiny import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cli") / "tiny.gguf")


def test_run_prints_tier_stats_and_writes_the_trace(tiny, tmp_path, capsys):
    trace = tmp_path / "trace.npz"
    argv = ["run", "-m", str(tiny), "-p", "hello", "-n", "6", "--experts-cache", "50%",
            "--pin-experts", "disk", "--cache-policy", "lru", "--trace-experts", str(trace)]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "[experts: " in err and "policy lru" in err and "[disk home: " in err
    assert f"[expert trace written to {trace}]" in err
    assert load_trace(trace).layers == [0, 1]


def test_run_json_carries_tier_stats(tiny, capsys):
    assert cli_main(["run", "-m", str(tiny), "-p", "hi", "-n", "4", "--experts-cache", "0", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]["tiers"]
    assert stats["total"]["cpu_experts"] > 0 and stats["total"]["hits"] == 0
    assert set(stats["per_layer"]) == {"0", "1"} and stats["plan"]["slots"] == 0


def test_run_refuses_a_bad_size_naming_the_flag(tiny, capsys):
    assert cli_main(["run", "-m", str(tiny), "-p", "hi", "--ram-cache", "12Q", "--pin-experts", "disk"]) == 2
    assert "--ram-cache '12Q' is not a size" in capsys.readouterr().err


def test_plain_path_without_tier_flags(tiny):
    import strata
    from strata.models.layers import Experts, ResidentExperts

    engine = strata.load(tiny)
    assert engine.tiers is None and "tiers" not in engine.stats
    assert all(isinstance(m.backend, ResidentExperts) for m in engine.model.modules() if isinstance(m, Experts))
    assert strata.load(tiny, cache_policy="lru").tiers is not None  # any tier option turns them on
