"""Expert parallelism on localhost (gloo): greedy output under 2 and 3 ranks equals one process's,
for qwen3moe (tests/test_scheduler.py's tiny random model with SmolLM2's tokenizer) and qwen4exp (the
bundled demo model, with and without its MTP drafts); a rank that never joins or dies is a one-line
error on rank 0 within --dist-timeout, and `strata serve` answers 503 with the reason.

Each configuration is one `torchrun --standalone` launch of `strata run` (the way users start it);
the fault tests start the ranks themselves with torchrun's environment (RANK, WORLD_SIZE, ...).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import strata
from strata.cli import main as cli_main
from strata.tiers.expert_parallel.share import Shares, _deal, _fractions, _quotas, partition
from test_scheduler import write_tiny_chat_gguf

ROOT = Path(strata.__file__).parent.parent
DEMO = Path(strata.__file__).parent / "demo" / "strata-demo.gguf"
N_OUT = 12
PROMPT = "The history of"


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def qwen3moe_path(tmp_path_factory):
    return write_tiny_chat_gguf(tmp_path_factory.mktemp("ep") / "qwen3moe.gguf")


def _run_args(model, draft: str) -> list[str]:
    return ["run", "-m", str(model), "-p", PROMPT, "-n", str(N_OUT), "--draft", draft, "--json", "--cpu-threads", "1"]


_REFERENCE: dict = {}


def single_process(model, draft: str, capsys) -> dict:
    """`strata run --json` in this process, once per model and draft setting."""
    key = (str(model), draft)
    if key not in _REFERENCE:
        assert cli_main(_run_args(model, draft)) == 0
        _REFERENCE[key] = json.loads(capsys.readouterr().out)
    return _REFERENCE[key]


def torchrun(model, draft: str, world: int, comm: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           "-m", "strata.cli", *_run_args(model, draft), "--expert-parallel", "--ep-comm", comm,
           "--dist-timeout", "60"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = [("qwen3moe", "off", 2, "broadcast"), ("qwen3moe", "off", 3, "alltoall"),
         ("qwen4exp", "off", 2, "alltoall"), ("qwen4exp", "off", 3, "broadcast"),
         ("qwen4exp", "on", 2, "broadcast"), ("qwen4exp", "on", 3, "alltoall")]


@pytest.mark.parametrize("arch,draft,world,comm", CASES, ids=[f"{a}-draft_{d}-{w}ranks-{c}" for a, d, w, c in CASES])
def test_greedy_output_equals_one_process(arch, draft, world, comm, qwen3moe_path, capsys):
    model = qwen3moe_path if arch == "qwen3moe" else DEMO
    ref = single_process(model, draft, capsys)
    got = torchrun(model, draft, world, comm)
    assert len(ref["token_ids"]) == N_OUT
    assert got["token_ids"] == ref["token_ids"] and got["text"] == ref["text"]
    tiers = got["stats"]["tiers"]
    ep = tiers["expert_parallel"]
    assert ep["world_size"] == world and ep["comm"] == comm and ep["broken"] is None
    shares = _shares(model, world)
    held = [tiers["experts_held"]] + [r["experts_held"] for r in ep["ranks"]]
    assert held == [s["experts"] for s in ep["shares"]] == [sum(len(v) for v in shares.of(r).values())
                                                            for r in range(world)]
    assert sum(held) == sum(shares.n_experts.values())
    assert all(r["requests"] > 0 for r in ep["ranks"])  # every rank computed its share
    assert ep["bytes_sent_per_token"] > 0 and ep["bytes_received_per_token"] > 0 and ep["comm_s"] > 0
    assert ep["per_layer"] and set(ep["per_layer"]) <= {str(k) for k in shares.layers}
    assert all(c["bytes_sent"] > 0 and c["calls"] > 0 for c in ep["per_layer"].values())
    if draft == "on":
        assert got["stats"]["draft"]["drafted"] > 0


def _shares(model, world: int) -> Shares:
    from strata.loader import open_config

    return partition(open_config(model)[2], world)


# -- the partition --------------------------------------------------------------------------------

def test_partition_balances_bytes_with_rank_0_dense_weights_counted():
    assert _fractions(2, dense=0, experts=100) == [0.5, 0.5]
    f = _fractions(2, dense=20, experts=100)  # 60 bytes per rank: rank 0 holds 40 of expert bytes
    assert f[0] == pytest.approx(0.4) and f[1] == pytest.approx(0.6)
    assert _fractions(3, dense=500, experts=100) == [0.0, 0.5, 0.5]
    q = _quotas(512, _fractions(3, dense=0, experts=1))
    assert sum(q) == 512 and max(q) - min(q) <= 1
    assert _deal(5, [2, 3], None) == [[0, 1], [2, 3, 4]]


def test_partition_by_trace_load_splits_the_hot_set():
    load = np.array([100, 90, 1, 1, 80, 70, 1, 1], dtype=float)
    a, b = _deal(8, [4, 4], load)
    assert sorted(a + b) == list(range(8)) and len(a) == len(b) == 4
    assert abs(load[a].sum() - load[b].sum()) <= 20  # contiguous ranges would give 192 vs 153
    contiguous = _deal(8, [4, 4], None)
    assert abs(load[contiguous[0]].sum() - load[contiguous[1]].sum()) > 20


def test_partition_of_a_file_covers_every_expert_once():
    from strata.loader import open_config

    _, _, source, _ = open_config(DEMO)
    shares = partition(source, 3)
    assert isinstance(shares, Shares) and shares.world == 3
    for layer, ranks in shares.layers.items():
        assert sorted(e for r in ranks for e in r) == list(range(shares.n_experts[layer]))
        owners = shares.owners(layer)
        assert all(owners[e] == r for r, experts in enumerate(ranks) for e in experts)
    assert partition(source, 3).fingerprint() == shares.fingerprint() != partition(source, 2).fingerprint()


def test_plan_prints_each_ranks_share(capsys):
    assert cli_main(["plan", "-m", str(DEMO), "--expert-parallel", "--world-size", "2", "--pin-experts", "disk"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel over 2 ranks" in out and "disk 9 layers" in out
    assert cli_main(["plan", "-m", str(DEMO), "--expert-parallel", "--world-size", "2", "--json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["expert_parallel"]
    assert [r["rank"] for r in ranks] == [0, 1] and sum(r["experts"] for r in ranks) == 9 * 32
    assert ranks[1]["tier_bytes"]["ram"] == ranks[1]["expert_bytes"] > 0  # a worker holds no dense weights


def test_run_without_torchrun_is_a_one_line_error(capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert cli_main(_run_args(DEMO, "off") + ["--expert-parallel"]) == 2
    err = capsys.readouterr().err
    assert "RANK is not set, so this is not a torchrun job" in err and "Traceback" not in err


# -- faults ---------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, argv: list[str]) -> subprocess.Popen:
    env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, "-m", "strata.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_rank_that_never_joins_is_an_error_within_the_timeout(qwen3moe_path):
    argv = _run_args(qwen3moe_path, "off") + ["--expert-parallel", "--dist-timeout", "3"]
    t0 = time.monotonic()
    p = _rank(0, 2, _free_port(), argv)  # rank 1 is never started
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("strata run: error: expert parallel: not all 2 ranks joined within "
                                "--dist-timeout 3 s"), err
    assert "Traceback" not in err and time.monotonic() - t0 < 40


FAULTS = {"dies": (signal.SIGKILL, "expert parallel: a rank stopped answering"),
          "goes silent": (signal.SIGSTOP, "expert parallel: a rank did not answer within --dist-timeout 8 s")}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_serve_answers_503_with_the_reason_when_a_rank_fails(qwen3moe_path, fault):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    sig, reason = FAULTS[fault]
    port, http = _free_port(), _free_port()
    argv = ["serve", "-m", str(qwen3moe_path), "--port", str(http), "--expert-parallel", "--dist-timeout", "8",
            "--cpu-threads", "1", "--log-level", "warning"]
    server, worker = _rank(0, 2, port, argv), _rank(1, 2, port, argv)
    url = f"http://127.0.0.1:{http}"
    body = {"model": "qwen3moe", "prompt": "Once upon", "max_tokens": 4, "temperature": 0}
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.communicate()[1][-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.3)
        ok = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        worker.send_signal(sig)
        t0 = time.monotonic()
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert failed.status_code == 503, failed.text
        message = failed.json()["error"]["message"]
        assert message.startswith(reason) and time.monotonic() - t0 < 8 + 15, message
        health = httpx.get(f"{url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["reason"] == message
    finally:
        for p in (server, worker):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.communicate(timeout=10)


def test_partition_by_a_recorded_trace_splits_each_layers_hot_experts(tmp_path):
    import torch

    from strata.loader import open_config
    from strata.tiers.trace import TraceRecorder

    _, _, source, _ = open_config(DEMO)
    layers = sorted(_shares(DEMO, 2).layers)
    rec = TraceRecorder(32)
    hot = torch.tensor([[0, 1]] * 24 + [[2, 3]] * 8)  # experts 0 and 1 three times as busy as 2 and 3
    for layer in layers:
        rec.next_step()
        rec.record(layer, None, hot, torch.full(hot.shape, 0.5))
    trace = rec.save(tmp_path / "trace.npz")
    by_trace, by_bytes = partition(source, 2, str(trace)), partition(source, 2)
    load = {0: 24, 1: 24, 2: 8, 3: 8}
    for layer in layers:
        ranks = by_trace.layers[layer]
        assert [len(r) for r in ranks] == [len(r) for r in by_bytes.layers[layer]]  # same bytes per rank
        assert [sum(load.get(e, 0) for e in r) for r in ranks] == [32, 32]
        assert [sum(load.get(e, 0) for e in r) for r in by_bytes.layers[layer]] == [48, 16]  # contiguous ranges
