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


def test_plan_chooses_blocks_or_floats_per_dense_weight_and_placement_follows(tmp_path, capsys, monkeypatch):
    """Dense Q8_0 weights on the device: all dequantized to bf16 at placement when the budget has
    room beside the cache, none when the cache takes it, some (in layer order) in between; the
    placement converts exactly the planned ones, each by one dequantize call."""
    from strata import quant
    from strata.gguf.convert import convert_hf_to_gguf
    from strata.models.linear import Linear
    from strata.tiers.placement import place_blocks
    from reference import randomise, save_hf
    from test_tiers import Q8_0, qwen3moe

    torch.manual_seed(0)
    save_hf(randomise(qwen3moe().eval()), tmp_path / "hf")
    path = convert_hf_to_gguf(tmp_path / "hf", tmp_path / "model.gguf", dense_type=Q8_0, expert_type=Q8_0)
    opts = dict(pin_experts="ram", gpu_layers="all", experts_cache="0")  # the plan's dtype: bfloat16
    roomy, _ = _plan(path, CUDA, 256, **opts)
    forms = roomy.dense_forms
    assert forms and set(forms.values()) == {"bfloat16"} and roomy.dense_extra > 0
    assert all(n.startswith("blk.") and "_exps" not in n for n in forms)
    base = roomy.dense_bytes("gpu") - roomy.dense_extra + roomy.reserved  # everything else, dense as blocks
    full, _ = _plan(path, CUDA, 256, **{**opts, "experts_cache": "auto", "gpu_memory": str(base + roomy.expert_bytes() // 2)})
    assert 0 < full.slots < full.n_experts  # the cache takes what is left
    assert set(full.dense_forms.values()) == {"blocks"} and full.dense_extra == 0
    half_budget = base + roomy.dense_extra // 2
    half, _ = _plan(path, CUDA, 256, **{**opts, "gpu_memory": str(half_budget)})
    chosen = [n for n, f in half.dense_forms.items() if f == "bfloat16"]
    assert 0 < len(chosen) < len(forms) and 0 < half.dense_extra <= roomy.dense_extra // 2
    assert half.dense_bytes("gpu") + half.reserved <= half.device_budget
    assert cli_main(["plan", "-m", str(path), "--pin-experts", "ram", "--gpu-layers", "all", "--experts-cache", "0",
                     "--gpu-memory", str(half_budget - half.reserved), "--ctx-size", "256"]) == 0  # simulated: no reserve
    out = capsys.readouterr().out
    assert (f"{len(forms) - len(chosen)} multiplied from their blocks (Triton), {len(chosen)} dequantized once "
            f"at placement to bfloat16") in out

    engine = strata_load(path)
    calls = []
    real = quant.dequantize
    monkeypatch.setattr(quant, "dequantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    place_blocks(engine.model, half, torch.device("cpu"), {n: torch.bfloat16 for n in chosen})
    linears = {}
    for m in engine.model.modules():
        for v in vars(m).values():
            if isinstance(v, Linear) and v.name in half.dense_forms:
                linears.setdefault(v.name, []).append(v)
    assert set(linears) == set(half.dense_forms)
    for name, ls in linears.items():
        want_float = name in chosen
        assert all((l.weight.dtype == torch.bfloat16) if want_float else l.quantized for l in ls), name
    assert len(calls) == sum(len(linears[n]) for n in chosen)  # one dequantize per converted weight, at placement


def strata_load(path):
    """The model with a `BlockPlacement` seam, as the tiers build it, so `place_blocks` can move it."""
    from strata.loader import load_model
    from strata.models.seams import Seams
    from strata.tiers.placement import BlockPlacement

    return load_model(path, torch.bfloat16, seams=Seams(placement=BlockPlacement()))
