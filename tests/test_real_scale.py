"""Real scale, kept small: a RAM budget far below the file is kept, and full-size shapes open.

* A synthetic qwen3moe file of about 400 MB runs with `--ram-memory 160M` (experts read from the
  file), after a 5-token prompt and after a 64-token one whose prefill reads most experts: its
  peak anonymous memory, above what the interpreter held before loading, stays within the
  budget + 5 %, and its greedy tokens equal the unconstrained run's.
* A sparse file (header, then holes from `truncate`) with the flagship's full tensor shapes
  (qwen4exp IQ2_XS, 4 of its 48 layers: Gated DeltaNet, the PLE layer and a QSA layer) opens,
  plans and generates a few tokens under a 3 GiB budget.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from strata import synth
from strata.tiers.budget import AnonPeak

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    import strata
    import strata.runtime.engine, strata.tiers.runtime, strata.kernels
    from strata.tiers.budget import anon_rss
    strata.kernels.available()  # the compiled kernels are libraries too
    path, options, prompt = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    base = anon_rss()  # the interpreter and its libraries: not in the budget
    engine = strata.load(path, cpu_threads=1, **options)
    ids = engine.generate([(7 * i) % 1000 + 1 for i in range(prompt)], 6, stop_at_eos=False)
    print(json.dumps({"base": base, "ids": ids, "ctx": engine.ctx_size, "memory": engine.memory.as_dict()}))
""")


def run_child(path, prompt=5, **options) -> tuple[dict, int]:
    """Generate after a prompt of `prompt` tokens in a fresh interpreter; (its report, its peak
    anonymous RSS)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), json.dumps(options), str(prompt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = AnonPeak(proc.pid, 0.01)
    out, err = proc.communicate(timeout=600)
    peak = watch.stop()
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1]), peak


@pytest.fixture(scope="module")
def mid_file(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("scale") / "mid.gguf", "qwen3-30b-a3b", 1, "Q4_K_M", vocab=1024)


@pytest.mark.parametrize("prompt", [5, 64])  # 64: a prefill touching most experts, each read from disk
def test_a_budget_far_below_the_file_is_kept_and_changes_no_token(mid_file, prompt):
    size = mid_file.stat().st_size
    budget = 160 * 2**20
    assert size > 2 * budget
    free, _ = run_child(mid_file, prompt)
    tight, peak = run_child(mid_file, prompt, ram_memory="160M", pin_experts="disk", experts_cache="0")
    assert tight["ids"] == free["ids"]
    assert tight["memory"]["total"] <= budget
    assert peak - tight["base"] <= 1.05 * budget, (peak, tight["base"], tight["memory"])


def test_a_budget_alone_reads_the_experts_from_the_file(mid_file):
    """--ram-memory without --pin-experts: experts that do not fit are read from the file, not refused."""
    report, peak = run_child(mid_file, ram_memory="160M", experts_cache="0")
    assert len(report["ids"]) == 6
    assert peak - report["base"] <= 1.05 * 160 * 2**20


def test_a_sparse_full_size_flagship_opens_plans_and_generates(tmp_path):
    path = synth.write(tmp_path / "sparse.gguf", "qwen4exp", 4, "IQ2_XS", sparse=True)
    report, peak = run_child(path, ram_memory="3G", pin_experts="auto")
    assert len(report["ids"]) == 6
    assert report["memory"]["ctx_chosen"] and report["ctx"] < 262144
    assert peak - report["base"] <= 1.05 * 3 * 2**30
