"""Tiered experts give the all-resident output for every cache size, policy and home.

Tiny transformers-built Qwen3-MoE (experts stored Q8_0) and Mixtral (experts F32) models,
converted to GGUF; the device tier is simulated on the CPU with the GPU's code path.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import strata
from strata.gguf.convert import convert_hf_to_gguf
from strata.models.layers import Experts, ResidentExperts
from strata.runtime.engine import EngineOptions
from strata.tiers.executor import TieredExperts
from strata.tiers.trace import load_trace
from reference import prompt, randomise, save_hf
from test_models import VOCAB, mixtral, qwen3moe

Q8_0, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
N_EXPERTS = 8 * 3  # experts per layer x MoE layers in both tiny models
SIZES = {"0": "0", "1slot": None, "30%": "30%", "70%": "70%", "100%": "100%"}
POLICIES = ["adaptive", "lru", "lfu", "static"]
DEMO = Path(strata.__file__).parent / "demo" / "strata-demo.gguf"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build_gguf(builder, expert_type, d: Path) -> Path:
    torch.manual_seed(0)
    save_hf(randomise(builder().eval()), d / "hf")
    return convert_hf_to_gguf(d / "hf", d / "model.gguf", expert_type=expert_type)


MODELS = {"qwen3moe-q8_0": (qwen3moe, Q8_0), "mixtral-f32": (mixtral, F32)}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    """(path, prompt, reference logits, reference greedy tokens, bytes per expert)."""
    builder, qtype = MODELS[request.param]
    path = build_gguf(builder, qtype, tmp_path_factory.mktemp(request.param))
    ids = prompt(VOCAB, 24)
    ref = strata.load(path)
    assert all(isinstance(m.backend, ResidentExperts) for m in ref.model.modules() if isinstance(m, Experts))
    slot = ref_slot_bytes(ref)
    return path, ids, ref.logits(ids), ref.generate(ids, 6, stop_at_eos=False), slot


def ref_slot_bytes(engine) -> int:
    m = next(m for m in engine.model.modules() if isinstance(m, Experts))
    return sum(q.nbytes for q in (m.backend.gate, m.backend.up, m.backend.down)) // m.n_experts


def cache_option(size: str, slot_bytes: int) -> str:
    return str(slot_bytes) if size == "1slot" else SIZES[size]


def check_exact(engine, ids, ref_logits, ref_tokens) -> None:
    diff = (engine.logits(ids) - ref_logits).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff}"
    assert engine.generate(ids, 6, stop_at_eos=False) == ref_tokens


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("size", list(SIZES))
def test_ram_home_is_exact_for_every_size_and_policy(model, size, policy):
    path, ids, ref_logits, ref_tokens, slot = model
    engine = strata.load(path, pin_experts="ram", experts_cache=cache_option(size, slot), cache_policy=policy)
    assert all(isinstance(m.backend, TieredExperts) for m in engine.model.modules() if isinstance(m, Experts))
    check_exact(engine, ids, ref_logits, ref_tokens)
    total = engine.stats["tiers"]["total"]
    assert total["hits"] + total["misses"] > 0
    if size == "0":
        assert total["hits"] == 0 and total["copied"] == 0
    if size == "100%" and policy != "static":
        assert total["hit_rate"] > 0.5
    engine.close()


@pytest.mark.parametrize("policy", ["adaptive", "lru"])
@pytest.mark.parametrize("size", list(SIZES))
def test_disk_home_is_exact(model, size, policy):
    path, ids, ref_logits, ref_tokens, slot = model
    engine = strata.load(path, pin_experts="disk", ram_cache=str(2 * slot),
                         experts_cache=cache_option(size, slot), cache_policy=policy)
    check_exact(engine, ids, ref_logits, ref_tokens)
    disk = next(h for h in engine.stats["tiers"]["homes"] if h["home"] == "disk")
    assert disk["bytes_read"] > 0
    engine.close()


@pytest.mark.parametrize("options", [
    dict(experts_cache="50%", prefill_reserve=3),
    dict(experts_cache="30%", prefetch=False, admission="always"),
    dict(experts_cache="30%", admission="frequency", cache_policy="lru", cpu_threads=2),
    dict(experts_cache="30%", override_tensor=(r"blk\.1\.ffn_.*_exps=gpu", r"blk\.2\.ffn_.*_exps=disk")),
], ids=["prefill-reserve", "no-prefetch", "frequency-admission", "overrides"])
def test_other_options_are_exact(model, options):
    path, ids, ref_logits, ref_tokens, _ = model
    engine = strata.load(path, **options)
    check_exact(engine, ids, ref_logits, ref_tokens)
    engine.close()


def test_batched_prompts_are_exact(model):
    path, ids, _, _, _ = model
    prompts = [ids, prompt(VOCAB, 9, seed=3), prompt(VOCAB, 17, seed=4)]
    ref = strata.load(path).generate(prompts, 5, stop_at_eos=False)
    engine = strata.load(path, experts_cache="30%", prefill_reserve=2)
    assert engine.generate(prompts, 5, stop_at_eos=False) == ref
    engine.close()


def test_stats_report_hits_prefetch_and_residency(model):
    path, ids, _, _, _ = model
    engine = strata.load(path, experts_cache="100%")
    engine.generate(ids, 8, stop_at_eos=False)
    first = engine.stats["tiers"]["total"]["hit_rate"]
    engine.generate(ids, 8, stop_at_eos=False)
    tiers = engine.stats["tiers"]
    t = tiers["total"]
    assert t["hit_rate"] > first  # the second pass over the same prompt finds its experts resident
    assert t["resident"] == sum(c["resident"] for c in tiers["per_layer"].values()) > 0
    assert 0 < t["prefetch_accuracy"] <= 1 and t["bytes_copied"] > 0
    assert set(tiers["per_layer"]) == {"0", "1", "2"}
    assert tiers["plan"]["slots"] == N_EXPERTS
    engine.close()


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


@pytest.mark.parametrize("cache", ["0", "30%"])
def test_disk_home_reads_only_the_experts_used(model, cache, tmp_path):
    path, _, _, _, slot = model
    engine = strata.load(path, pin_experts="disk", ram_cache="100%", experts_cache=cache, prefetch=False,
                         trace_experts=str(tmp_path / "t.npz"))
    before = io_counters()
    engine.generate(prompt(VOCAB, 2), 2, stop_at_eos=False)
    after = io_counters()
    rows = engine.tiers.executor.tracer.rows
    used = {(layer, e) for _, layer, _, ids, _ in rows for e in np.unique(ids).tolist()}
    disk = next(h for h in engine.stats["tiers"]["homes"] if h["home"] == "disk")
    assert disk["bytes_read"] == len(used) * slot < N_EXPERTS * slot
    assert disk["device_bytes_read"] <= disk["bytes_read"] + len(used) * 3 * 2 * 4096
    assert after["rchar"] - before["rchar"] < disk["device_bytes_read"] + 64 * 1024
    engine.close()


def test_inference_writes_nothing_to_disk(model):
    path, ids, _, _, _ = model
    for options in ({}, dict(pin_experts="disk", experts_cache="30%")):
        engine = strata.load(path, **options)
        before = io_counters()
        engine.generate(ids, 6, stop_at_eos=False)
        assert io_counters()["write_bytes"] == before["write_bytes"], options
        engine.close()


def test_trace_records_every_routing_decision(model, tmp_path):
    path, ids, _, _, _ = model
    engine = strata.load(path, trace_experts=str(tmp_path / "trace.npz"), experts_cache="0")
    engine.generate(ids, 4, stop_at_eos=False)
    assert not (tmp_path / "trace.npz").exists()  # written once, at close
    assert engine.close() == str(tmp_path / "trace.npz")
    trace = load_trace(tmp_path / "trace.npz")
    assert trace.layers == [0, 1, 2] and trace.n_experts == 8
    assert len(trace.layer) == 3 * 4  # prefill + 3 decode steps, 3 MoE layers each
    assert trace.ids.shape == (3 * (len(ids) + 3), 2)
    first = trace.position[: len(ids)].tolist()
    assert first == list(range(len(ids)))
    assert np.allclose(trace.weights.astype(np.float32).sum(1), 1.0, atol=2e-3)  # normalised top-k


def test_static_hot_set_from_a_trace(model, tmp_path):
    path, ids, ref_logits, ref_tokens, _ = model
    engine = strata.load(path, trace_experts=str(tmp_path / "t.npz"))
    engine.generate(ids, 6, stop_at_eos=False)
    engine.close()
    static = strata.load(path, cache_policy="static", experts_cache="30%", hot_set=str(tmp_path / "t.npz"))
    assert len(static.tiers.cache.where) == int(0.3 * N_EXPERTS)  # preloaded before any request
    check_exact(static, ids, ref_logits, ref_tokens)
    static.close()


@pytest.mark.skipif(not DEMO.exists(), reason="the demo model has not been trained yet")
@pytest.mark.parametrize("size", ["0", "30%", "100%"])
def test_demo_model_is_exact(size):
    ref = strata.load(DEMO)
    ids = prompt(min(ref.config.vocab_size, 256), 16)
    engine = strata.load(DEMO, experts_cache=size, pin_experts="disk" if size == "30%" else "ram")
    check_exact(engine, ids, ref.logits(ids), ref.generate(ids, 6, stop_at_eos=False))
    engine.close()


def test_block_placement_keeps_outputs(model):
    """The CUDA placement path (moved blocks, device-built step masks, the model's BlockPlacement)
    forced onto the CPU."""
    from strata.tiers.placement import place_blocks

    path, ids, ref_logits, ref_tokens, _ = model
    engine = strata.load(path, experts_cache="30%", gpu_layers="2")
    assert place_blocks(engine.model, engine.tiers.plan, torch.device("cpu")) == [0, 1]
    check_exact(engine, ids, ref_logits, ref_tokens)
    engine.close()


def test_safetensors_directory_with_ram_home(model):
    path, ids, _, _, _ = model
    ref = strata.load(path.parent / "hf")  # F32 experts: its own reference, not the GGUF's
    engine = strata.load(path.parent / "hf", experts_cache="30%")
    check_exact(engine, ids, ref.logits(ids), ref.generate(ids, 6, stop_at_eos=False))
    engine.close()
    with pytest.raises(strata.StrataError, match="only from a GGUF file"):
        strata.load(path.parent / "hf", pin_experts="disk")


def test_plain_reference_path_without_kernels(model, monkeypatch):
    """With the compiled kernels off, resident and tiered both dequantize and matmul."""
    from strata import kernels

    monkeypatch.setattr(kernels, "USE_KERNELS", False)
    path, ids, _, _, _ = model
    ref = strata.load(path)
    engine = strata.load(path, experts_cache="30%", pin_experts="disk")
    check_exact(engine, ids, ref.logits(ids), ref.generate(ids, 6, stop_at_eos=False))
    engine.close()


@pytest.mark.parametrize("policy,reserve", [("adaptive", 0), ("lru", 0), ("adaptive", 2), ("lfu", 2)])
def test_simulator_counts_what_the_runtime_counts(model, tmp_path, policy, reserve):
    """Replaying the run's own trace (routing, prefill flags, predictions) gives the runtime's counters."""
    from strata.tiers.cache_sim import replay_trace

    path, ids, _, _, _ = model
    engine = strata.load(path, experts_cache="30%", cache_policy=policy, prefill_reserve=reserve,
                         prefill_chunk=8, trace_experts=str(tmp_path / "t.npz"))
    engine.generate(ids, 10, stop_at_eos=False)
    engine.generate(prompt(VOCAB, 11, seed=5), 6, stop_at_eos=False)
    runtime = engine.tiers.executor.stats.as_dict({})["total"]
    plan = engine.tiers.plan
    engine.close()
    trace = load_trace(tmp_path / "t.npz")
    assert trace.version == 2 and trace.has_predictions and trace.prefill_flags().count(True) == 3 * (3 + 2)
    sim = replay_trace(trace, policy, plan.slots, plan.prefill_reserve).total()
    counters = ("hits", "misses", "copied", "cpu_experts", "prefetched", "prefetch_hits", "predicted_used",
                "bytes_copied")
    assert {c: sim[c] for c in counters} == {c: runtime[c] for c in counters}
    assert runtime["prefetched"] > 0 and sim["hit_rate"] == runtime["hit_rate"]


def main_resident(engine) -> set[int]:
    main = next(r for r in engine.tiers.cache.regions if r.name == "main")
    return set(main.policy.resident)


@pytest.mark.parametrize("policy", ["adaptive", "lru"])
def test_prefill_reserve_keeps_the_decode_set(model, policy):
    """A long prompt, prefilled in chunks, goes through the reserved slots and leaves decode's alone."""
    path, ids, _, _, slot = model
    long_prompt = prompt(VOCAB, 64, seed=7)
    disturbed = {}
    for reserve in (0, 4):
        engine = strata.load(path, experts_cache=str(16 * slot), cache_policy=policy, prefill_reserve=reserve,
                             prefill_chunk=8)
        engine.generate(ids[:4], 12, stop_at_eos=False)  # decode steps fill the main region
        before = main_resident(engine)
        engine.generate(long_prompt, 1, stop_at_eos=False)  # prefill only: 8 chunks of 8 tokens
        disturbed[reserve] = main_resident(engine) != before
        assert len(before) == 16 - reserve
        engine.close()
    assert disturbed == {0: True, 4: False}


def test_verify_passes_count_as_decode():
    """A speculative verify pass (last token + drafts) is decode; only wider forwards use the prefill slots."""
    from types import SimpleNamespace

    from strata.tiers.runtime import _decode_width

    drafting = SimpleNamespace(mtp=object())
    assert _decode_width(drafting, SimpleNamespace(draft="auto", draft_tokens=3)) == 4
    assert _decode_width(drafting, SimpleNamespace(draft="off", draft_tokens=3)) == 1
    assert _decode_width(SimpleNamespace(), SimpleNamespace(draft="on", draft_tokens=3)) == 1


def _attributes(model) -> dict:
    """Every module's attributes that are not tensors (tensors move between devices), by identity,
    and its forward hooks."""
    out = {}
    for name, m in model.named_modules():
        for key, value in vars(m).items():
            if key in ("_parameters", "_buffers", "_modules") or isinstance(value, torch.Tensor):
                continue
            out[(name, key)] = id(value)
        out[(name, "hooks")] = (len(m._forward_pre_hooks), len(m._forward_hooks))
    return out


def test_tiers_plug_in_at_construction_and_assign_nothing_onto_the_model(model, tmp_path):
    """The tiers reach the model only through the seams it was built with (`strata.models.seams`):
    installing the expert tiers, placing the blocks and configuring tiered KV add or replace no
    attribute of any module of the built model and register no forward hook."""
    from strata.loader import load_model
    from strata.models.seams import ExpertLayer, ExpertsProvider, Placement, Seams
    from strata.tiers.kv_tiers import TieredKV
    from strata.tiers.ngram_table import open_table
    from strata.tiers.placement import BlockPlacement, place_blocks
    from strata.tiers.runtime import TieredProvider, install

    path, ids, ref_logits, ref_tokens, _ = model
    provider, kv = TieredProvider(), TieredKV("64M", torch.float32)
    loaded = load_model(path, seams=Seams(provider, kv, open_table, BlockPlacement()))
    assert isinstance(provider, ExpertsProvider) and isinstance(loaded.model.seams.placement, Placement)
    experts = [m for m in loaded.model.modules() if isinstance(m, Experts)]
    assert experts and all(isinstance(m.backend, TieredExperts) and isinstance(m.backend, ExpertLayer)
                           and m.backend.provider is provider for m in experts)
    assert set(provider.weights) == {m.layer for m in experts}
    before = _attributes(loaded.model)
    options = EngineOptions.from_kwargs(experts_cache="30%", gpu_layers="1", trace_experts=str(tmp_path / "t.npz"))
    runtime = install(loaded, options)
    assert place_blocks(loaded.model, runtime.plan, torch.device("cpu")) == [0]
    kv.configure(loaded.model)
    assert _attributes(loaded.model) == before
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids]), loaded.model.new_cache(1))[0]
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert runtime.executor.host_reads > 0  # the tiers served the experts
    runtime.close()


def test_a_file_larger_than_the_ram_budget_reads_its_experts_from_the_file_without_flags(model, monkeypatch):
    """No tier flag, a file larger than RAM can hold: the experts are read from the file (as
    --pin-experts auto), not the whole file mapped and paged by the kernel; still exact."""
    import os

    from strata.tiers import auto, hardware

    path, ids, ref_logits, ref_tokens, _ = model
    fits = strata.load(path)
    assert not auto.exceeds_ram(fits.loaded.source) and fits.tiers is None  # fits: the plain resident path
    fits.close()
    # the tiny file stands for one larger than RAM: the share of the budget the weights may take shrinks
    monkeypatch.setattr(auto, "RAM_HEADROOM", os.path.getsize(path) / hardware.ram_default_budget() / 2)
    engine = strata.load(path)
    assert engine.tiers is not None and set(engine.tiers.stats()["plan"]["expert_homes"]) == {"disk"}
    check_exact(engine, ids, ref_logits, ref_tokens)
    engine.close()


def test_a_disk_homes_demanded_reads_go_before_its_reads_ahead():
    """The next layer's predicted reads are queued before this layer routes; its misses must not
    wait behind them, and a queued read ahead that a layer asks for moves to the front."""
    import threading

    from strata.tiers.store import ReadQueue

    started, order = threading.Event(), []
    gate = threading.Event()

    def fetch(key):
        if key == "first":
            started.set()
            gate.wait(10)
        order.append(key)
        return key

    q = ReadQueue(fetch, threads=1)
    first = q.submit("first", urgent=False)
    assert started.wait(10)  # the one reader is busy: the rest queue up
    later = [q.submit(k, urgent=False) for k in ("a1", "a2", "a3")]
    demand = q.submit("d1", urgent=True)
    q.promote("a3")
    q.promote("d1")  # already urgent: nothing changes
    gate.set()
    q.shutdown()
    assert order == ["first", "d1", "a3", "a1", "a2"]
    assert first.result() == "first" and demand.result() == "d1" and [f.result() for f in later] == ["a1", "a2", "a3"]
