"""The placement plan: sizes, budgets, overrides, and clear refusals naming the flag."""

from __future__ import annotations

import pytest
import torch

import strata
from strata.cli import main as cli_main
from strata.errors import BadOption
from strata.formats.checkpoint import open_config
from strata.tiers.hardware import DeviceInfo
from strata.tiers.options import TierOptions
from strata.tiers.plan import make_plan
from strata.tiers.sizes import parse_size
from test_tiers import F32, build_gguf, mixtral

PER_EXPERT = 3 * 64 * 48 * 4  # gate + up + down, F32, hidden 64, ffn 48
N_EXPERTS = 3 * 8
MiB = 2**20
DEVICE = DeviceInfo("test device", torch.device("cpu"), 64 * MiB)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return build_gguf(mixtral, F32, tmp_path_factory.mktemp("plan"))


def plan_for(path, **options):
    _, config, source, _ = open_config(path)
    return make_plan(source, config, TierOptions(**options), DEVICE)


@pytest.mark.parametrize("text,expected", [("23.44G", int(23.44 * 2**30)), ("512M", 512 * MiB), ("4096", 4096),
                                           ("1.5k", 1536), ("2GiB", 2 * 2**30), ("8 GB", 8 * 2**30)])
def test_sizes_parse(text, expected):
    assert parse_size(text, "--x") == expected


@pytest.mark.parametrize("text", ["lots", "-1G", "0", "1.2.3M", "12Q", ""])
def test_bad_sizes_name_the_flag(text):
    with pytest.raises(BadOption, match="--ram-cache"):
        parse_size(text, "--ram-cache")


def test_plan_counts_bytes_per_tier_and_slots(gguf_path):
    plan = plan_for(gguf_path, experts_cache="30%", pin_experts="ram")
    assert plan.slot_bytes == PER_EXPERT and plan.n_experts == N_EXPERTS
    assert plan.slots == int(0.3 * N_EXPERTS)
    tiers = plan.tier_bytes()
    assert tiers["gpu"] == plan.dense_bytes("gpu") + plan.slots * PER_EXPERT
    assert tiers["ram"] == plan.dense_bytes("ram") + N_EXPERTS * PER_EXPERT and tiers["disk"] == 0
    assert plan.gpu_layers == 3  # auto: every block fits the 64 MiB device
    assert all(plan.homes[n] == "gpu" for n in plan.homes if n.startswith("blk.") and "_exps" not in n)
    assert plan.homes["token_embd.weight"] == "gpu"  # every block on the device: the head joins them


def test_auto_cache_fills_what_the_device_has_left(gguf_path):
    _, config, source, _ = open_config(gguf_path)
    cuda = DeviceInfo("test cuda", torch.device("cuda"), 64 * MiB)  # planning only: nothing is allocated
    reserved = make_plan(source, config, TierOptions(gpu_memory="1G"), cuda).reserved  # KV, activations, scratch
    small = 2 * MiB + reserved
    plan = make_plan(source, config, TierOptions(gpu_memory=str(small), experts_cache="auto"), cuda)
    assert plan.reserved == reserved
    assert plan.slots == min((small - plan.dense_bytes("gpu") - reserved) // PER_EXPERT, N_EXPERTS)
    assert plan.tier_bytes()["gpu"] <= small


def test_without_cuda_auto_allocates_no_stand_in_cache(gguf_path):
    plan = plan_for(gguf_path, gpu_memory="2M", experts_cache="auto")
    assert plan.slots == 0 and plan.memory.device_standin == 0
    asked = plan_for(gguf_path, experts_cache="30%")  # asked for explicitly: it is built, and counted in RAM
    assert asked.slots == int(0.3 * N_EXPERTS) and asked.memory.device_standin == asked.slots * PER_EXPERT


def test_ram_budget_counts_every_line_and_refuses_with_the_numbers(gguf_path):
    plan = plan_for(gguf_path, pin_experts="disk")
    m = plan.memory
    assert m.ctx_chosen and m.ctx_size >= 256 and m.kv > 0 and m.scratch > 0 and m.ram_cache == plan.ram_cache
    assert m.total <= plan.ram_budget
    with pytest.raises(BadOption) as e:
        plan_for(gguf_path, pin_experts="ram", ram_memory=str(N_EXPERTS * PER_EXPERT))
    assert "experts" in str(e.value) and "--pin-experts disk" in str(e.value)


def test_disk_home_and_ram_cache(gguf_path):
    plan = plan_for(gguf_path, pin_experts="disk", ram_cache="25%", experts_cache="0")
    assert plan.tier_bytes()["disk"] == N_EXPERTS * PER_EXPERT
    assert plan.ram_cache == int(0.25 * N_EXPERTS * PER_EXPERT) and plan.slots == 0


def test_overrides_place_layers(gguf_path):
    plan = plan_for(gguf_path, override_tensor=(r"blk\.0\.ffn_.*_exps=CPU", "exps=disk", r"blk\.2\.attn=ram"))
    homes = {layer.layer: layer.home for layer in plan.experts}
    assert homes == {0: "ram", 1: "disk", 2: "disk"}
    assert plan.homes["blk.2.attn_q.weight"] == "ram" and plan.homes["blk.1.attn_q.weight"] == "gpu"
    assert [n for _, _, n in plan.overrides] == [3, 6, 5]


@pytest.mark.parametrize("options,flag", [
    (dict(gpu_memory="1M", experts_cache="2M"), "--experts-cache"),
    (dict(gpu_memory="64K", gpu_layers="3"), "--gpu-layers"),
    (dict(ram_memory="100K", pin_experts="ram"), "--pin-experts disk"),
    (dict(pin_experts="disk", ram_cache="1K"), "--ram-cache"),
    (dict(experts_cache="100"), "--experts-cache"),
    (dict(experts_cache="-3M"), "--experts-cache"),
    (dict(experts_cache="huge"), "--experts-cache"),
    (dict(gpu_memory="0"), "--gpu-memory"),
    (dict(gpu_layers="many"), "--gpu-layers"),
    (dict(experts_cache="30%", prefill_reserve=100), "--prefill-reserve"),
    (dict(override_tensor=("exps",)), "--override-tensor"),
    (dict(override_tensor=("attn_q=disk",)), "--override-tensor"),
    (dict(override_tensor=(r"blk\.0\.ffn_gate_exps=gpu",)), "--override-tensor"),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={v}" for k, v in v.items()))
def test_plans_that_cannot_fit_are_refused_naming_the_flag(gguf_path, options, flag):
    with pytest.raises(BadOption) as e:
        plan_for(gguf_path, **options)
    assert flag in str(e.value)


def test_load_refuses_bad_options_too(gguf_path):
    with pytest.raises(BadOption, match="--experts-cache"):
        strata.load(gguf_path, experts_cache="lots")


def test_plan_command_prints_the_plan(gguf_path, capsys):
    assert cli_main(["plan", "--model", str(gguf_path), "--gpu-memory", "2M", "--experts-cache", "50%"]) == 0
    out = capsys.readouterr().out
    assert "bytes per expert 36.00 KiB" in out and f"{2**30 // PER_EXPERT} experts per GiB" in out
    assert f"expert cache {N_EXPERTS // 2} slots" in out
    for tier in ("gpu", "ram", "disk"):
        assert f"\n  {tier} " in out


def test_plan_command_refuses_with_numbers(gguf_path, capsys):
    assert cli_main(["plan", "--model", str(gguf_path), "--gpu-memory", "1M", "--experts-cache", "4M"]) == 2
    err = capsys.readouterr().err
    assert "--experts-cache 4M needs 4.00 MiB" in err and "raise --gpu-memory" in err
