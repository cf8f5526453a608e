"""The device budget keeps KV (at --ctx-size), recurrent state, activations and scratch before the
expert cache takes the rest; `strata plan` prints each line."""

from __future__ import annotations

import torch

from strata.cli import main as cli_main
from strata.formats.checkpoint import open_config
from strata.tiers import device_budget
from strata.tiers.hardware import DeviceInfo
from strata.tiers.options import TierOptions
from strata.tiers.plan import make_plan
from test_tiers import F32, build_gguf, mixtral

MiB = 2**20
DEMO = "strata/demo/strata-demo.gguf"
CUDA = DeviceInfo("cuda (test)", torch.device("cuda", 0), 1024 * MiB)  # planned only: nothing is allocated
SIMULATED = DeviceInfo("cpu (simulated device)", torch.device("cpu"), 1024 * MiB)


def _plan(path, device, ctx, **options):
    _, config, source, _ = open_config(path)
    return make_plan(source, config, TierOptions(**options), device, ctx_size=ctx), config


def test_kv_reserve_is_every_attention_layers_keys_and_values_at_the_context(tmp_path):
    path = build_gguf(mixtral, F32, tmp_path)
    plan, c = _plan(path, CUDA, 1000, pin_experts="ram")
    # every mixtral layer attends: K and V of n_kv_heads x head_dim per position, bf16 (the plan's default)
    assert plan.device_reserve["kv"] == c.n_layers * 2 * c.n_kv_heads * c.head_dim * 1000 * 2
    assert plan.device_reserve["recurrent"] == 0
    assert plan.device_reserve["scratch"] == device_budget.SCRATCH_MIN


def test_reserve_comes_out_of_the_expert_cache_on_a_real_device():
    cuda, config = _plan(DEMO, CUDA, 32768, pin_experts="ram", experts_cache="auto", gpu_memory="392M")
    sim, _ = _plan(DEMO, SIMULATED, 32768, pin_experts="ram", experts_cache="auto", gpu_memory="392M")
    r = cuda.device_reserve
    assert r == sim.device_reserve and cuda.reserve_applies and not sim.reserve_applies
    assert r["recurrent"] > 0 and r["kv"] > 0 and r["activations"] > 0  # DeltaNet + QSA layers
    free = cuda.device_budget - cuda.dense_bytes("gpu") - sum(r.values())
    assert cuda.slots == min(free // cuda.slot_bytes, cuda.n_experts)
    assert 0 < cuda.slots < cuda.n_experts  # the reserve, not the budget, bounds the cache
    longer, _ = _plan(DEMO, CUDA, 40960, pin_experts="ram", experts_cache="auto", gpu_memory="392M")
    assert longer.device_reserve["kv"] == r["kv"] * 40960 // 32768 and 0 < longer.slots < cuda.slots
    assert cuda.homes["token_embd.weight"] == "gpu" and cuda.homes["output.weight"] == "gpu"


def test_plan_prints_each_reserve_line(capsys):
    assert cli_main(["plan", "-m", DEMO, "--pin-experts", "ram", "--ctx-size", "8192"]) == 0
    out = capsys.readouterr().out
    for line in ("device reserve", "kv cache", "at --ctx-size 8192", "recurrent", "activations", "scratch"):
        assert line in out
