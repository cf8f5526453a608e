"""`strata synth`: valid random blocks, real shapes and metadata, a file strata (and llama.cpp) load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import strata
from strata import quant, synth
from strata.cli import main as cli_main
from strata.errors import StrataError
from strata.gguf.reader import GGUFFile


@pytest.mark.parametrize("qtype", synth.RANDOM_BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks_are_valid(qtype):
    q = quant.get(qtype)
    blocks = synth.random_blocks(qtype, 200, np.random.default_rng(0))
    assert blocks.shape == (200, q.type_size) and blocks.dtype == np.uint8
    values = q.dequantize_blocks(torch.from_numpy(blocks))
    assert torch.isfinite(values).all()
    rms = float(values.pow(2).mean().sqrt())
    assert 0.5 * synth.WEIGHT_RMS < rms < 2 * synth.WEIGHT_RMS, rms
    assert abs(float(values.mean())) < 0.25 * rms


def test_random_f16():
    v = synth.random_f16(np.random.default_rng(0), 10000)
    assert v.dtype == np.float16 and np.isfinite(v).all()
    assert 0.3 * synth.WEIGHT_RMS < float(np.sqrt((v.astype(np.float32) ** 2).mean())) < 3 * synth.WEIGHT_RMS


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "q4km.gguf"
    assert cli_main(["synth", "--like", "qwen3-30b-a3b", "--layers", "1", "--quant", "Q4_K_M",
                     "--vocab", "1024", str(path)]) == 0
    return path


def test_metadata_and_shapes_match_the_model(q4km):
    like = synth.LIKE["qwen3-30b-a3b"]
    f = GGUFFile(q4km)
    m = f.metadata
    assert f.arch == "qwen3moe"
    a = "qwen3moe"
    assert m[f"{a}.block_count"] == 1
    assert m[f"{a}.embedding_length"] == like.hidden_size == 2048
    assert m[f"{a}.expert_count"] == like.n_experts == 128
    assert m[f"{a}.expert_used_count"] == like.n_experts_used == 8
    assert m[f"{a}.expert_feed_forward_length"] == like.expert_ffn_size == 768
    assert m[f"{a}.attention.head_count"] == 32 and m[f"{a}.attention.head_count_kv"] == 4
    assert m[f"{a}.attention.key_length"] == m[f"{a}.attention.value_length"] == 128
    assert m[f"{a}.vocab_size"] == 1024 and len(m["tokenizer.ggml.tokens"]) == 1024
    assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.merges"]
    assert m["general.quantization_version"] == 2

    t = f.tensors
    assert t["blk.0.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert t["blk.0.ffn_up_exps.weight"].shape == (128, 768, 2048)
    assert t["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert t["blk.0.attn_q.weight"].shape == (32 * 128, 2048)
    assert t["blk.0.attn_k.weight"].shape == (4 * 128, 2048)
    assert t["blk.0.attn_output.weight"].shape == (2048, 32 * 128)
    assert t["blk.0.ffn_gate_inp.weight"].shape == (128, 2048)
    assert t["token_embd.weight"].shape == (1024, 2048)
    # Q4_K_M: Q4_K experts, Q6_K for the output and (layer 0 of 1) ffn_down / attn_v
    assert t["blk.0.ffn_gate_exps.weight"].qtype == T.Q4_K
    assert t["blk.0.ffn_down_exps.weight"].qtype == T.Q6_K
    assert t["output.weight"].qtype == T.Q6_K
    assert t["blk.0.attn_norm.weight"].qtype == T.F32
    plan = synth.tensor_plan(like, 1, 1024, "Q4_K_M")
    assert {n for n, *_ in plan} == set(t)
    for name, shape, qtype, _ in plan:
        assert t[name].shape == shape and t[name].qtype == qtype
        assert t[name].n_bytes == quant.row_bytes(qtype, shape[-1]) * int(np.prod(shape[:-1]))


def test_strata_loads_and_generates(q4km):
    engine = strata.load(q4km)
    ids = engine.tokenizer.encode("hello world")
    assert ids and max(ids) < 1024
    out = engine.generate(ids, max_new_tokens=4, stop_at_eos=False)
    assert len(out) == 4 and all(0 <= t < 1024 for t in out)
    logits = engine.logits(ids)
    assert torch.isfinite(logits).all()


def test_iq2_xs_mix(tmp_path):
    path = synth.write(tmp_path / "iq2.gguf", layers=1, quant_name="IQ2_XS", vocab=512)
    t = GGUFFile(path).tensors
    assert t["blk.0.ffn_gate_exps.weight"].qtype == T.IQ2_XS
    assert t["blk.0.ffn_up_exps.weight"].qtype == T.IQ2_XS
    engine = strata.load(path)
    assert len(engine.generate([300, 301], max_new_tokens=2, stop_at_eos=False)) == 2


def test_qwen3_next_file(tmp_path):
    """qwen3next: 3 Gated DeltaNet layers then gated attention, 512 experts of 512 (16 kept here)."""
    like = synth.LIKE["qwen3-next-80b"]
    path = synth.write(tmp_path / "next.gguf", like_name="qwen3-next-80b", layers=4, vocab=512, experts=16,
                       quant_name="Q8_0")
    f = GGUFFile(path)
    m, t = f.metadata, f.tensors
    a = "qwen3next"
    assert f.arch == a and m[f"{a}.block_count"] == 4 and m[f"{a}.full_attention_interval"] == 4
    assert m[f"{a}.expert_count"] == 16 and m[f"{a}.expert_feed_forward_length"] == 512
    assert m[f"{a}.expert_used_count"] == 10 and m[f"{a}.embedding_length"] == 2048
    assert m[f"{a}.expert_shared_feed_forward_length"] == 512 and m[f"{a}.rope.dimension_count"] == 64
    assert m[f"{a}.attention.head_count"] == 16 and m[f"{a}.attention.head_count_kv"] == 2
    assert m[f"{a}.ssm.group_count"] == 16 and m[f"{a}.ssm.time_step_rank"] == 32
    assert m[f"{a}.ssm.state_size"] == 128 and m[f"{a}.ssm.inner_size"] == 32 * 128
    assert m[f"{a}.ssm.conv_kernel"] == 4
    assert t["blk.0.attn_qkv.weight"].shape == (2 * 16 * 128 + 32 * 128, 2048)  # as llama.cpp's converter
    assert t["blk.0.attn_gate.weight"].shape == (32 * 128, 2048)
    assert "blk.0.ssm_in.weight" not in t
    assert t["blk.0.ssm_conv1d.weight"].shape == (2 * 16 * 128 + 32 * 128, 4)
    assert t["blk.3.attn_q.weight"].shape == (2 * 16 * 256, 2048)  # [query | gate] per head
    assert t["blk.3.attn_k.weight"].shape == (2 * 256, 2048)
    assert t["blk.0.ffn_gate_exps.weight"].shape == (16, 512, 2048)
    assert t["blk.0.ffn_down_shexp.weight"].shape == (2048, like.shared_ffn_size)
    assert "blk.0.attn_q.weight" not in t and "blk.3.attn_qkv.weight" not in t
    plan = synth.tensor_plan(like, 4, 512, "Q8_0", experts=16)
    assert {n for n, *_ in plan} == set(t)


def test_qwen3_next_loads(tmp_path):
    path = synth.write(tmp_path / "next1.gguf", like_name="qwen3-next-80b", layers=1, vocab=512, experts=16,
                       quant_name="Q8_0")
    engine = strata.load(path)
    assert engine.config.recurrent == (True,)
    assert len(engine.generate([300, 301], max_new_tokens=2, stop_at_eos=False)) == 2


def test_refuses_bad_options(tmp_path, capsys):
    for bad in (dict(quant_name="Q3_K_S"), dict(vocab=100), dict(like_name="llama-7b"), dict(experts=0),
                dict(ngram_rows=1000), dict(like_name="qwen4exp", ngram_rows=5)):
        with pytest.raises(StrataError):
            synth.write(tmp_path / "x.gguf", **bad)
    assert not (tmp_path / "x.gguf").exists()
    assert cli_main(["synth", "--like", "qwen3-30b-a3b", "--ngram-rows", "1000", str(tmp_path / "y.gguf")]) == 2
    assert "only qwen4exp" in capsys.readouterr().err


def test_qwen4exp_plan_has_the_real_shapes():
    """48 layers of the real model, planned (not written): shapes, types and metadata."""
    like = synth.LIKE["qwen4exp"]
    plan = {name: (shape, qtype) for name, shape, qtype, _ in
            synth.tensor_plan(like, 48, like.vocab_size, "Q4_K_M", ngram_rows=like.ple_rows)}
    assert plan["blk.0.ffn_gate_exps.weight"][0] == (512, 640, 2560)  # one expert: 3 x 2560 x 640
    assert plan["blk.0.ffn_down_exps.weight"] == ((512, 2560, 640), T.Q8_0)  # 640 wide: no K-quant blocks
    assert plan["blk.7.ffn_down_exps.weight"][1] == T.Q5_0  # Q4_K's fallback
    assert plan["blk.0.attn_qkv.weight"][0] == (2 * 16 * 128 + 48 * 128, 2560)  # GDN 16 key / 48 value heads
    assert plan["blk.0.ssm_out.weight"][0] == (2560, 48 * 128)
    assert plan["blk.3.attn_q.weight"][0] == (2 * 24 * 256, 2560) and plan["blk.3.attn_k.weight"][0] == (512, 2560)
    assert plan["blk.3.indexer.q_proj.weight"][0] == (4 * 128, 2560)
    assert plan["blk.0.hc_attn_down.weight"][0] == (320, 4 * 2560)
    assert plan["blk.1.ple_key.weight"][0] == (4 * 2560, 16 * 160) and "blk.0.ple_key.weight" not in plan
    assert plan["per_layer_token_embd.weight"] == ((320_001_536, 160), T.Q4_0)
    assert plan["output.weight"] == ((248320, 2560), T.Q6_K)
    assert not any(n.startswith("blk.48.") for n in plan)  # no MTP block
    for name, (shape, qtype) in plan.items():
        assert shape[-1] % quant.get(qtype).block_size == 0, name
    table = 320_001_536 * quant.row_bytes(T.Q4_0, 160)
    assert abs(table / 1e9 - 28.8) < 0.05  # the report's 28.8 GB table

    meta = synth.metadata(like, 48, like.vocab_size, "Q4_K_M", "qwen4exp", ngram_rows=like.ple_rows)
    a = "qwen4exp"
    assert (meta[f"{a}.embedding_length"], meta[f"{a}.block_count"], meta[f"{a}.expert_count"]) == (2560, 48, 512)
    assert meta[f"{a}.full_attention_interval"] == 4 and meta[f"{a}.hyper_connection.count"] == 4
    assert meta[f"{a}.attention.indexer.top_k"] == 2048 and meta[f"{a}.ple.layers"] == [1]


def test_qwen4exp_file_loads_in_strata(tmp_path):
    """4 layers (GDN, GDN + n-gram table, GDN, QSA) at the real widths, 2 experts, a tiny vocabulary."""
    path = synth.write(tmp_path / "q4.gguf", like_name="qwen4exp", layers=4, vocab=300, experts=2,
                       quant_name="Q8_0", ngram_rows=4096)
    f = GGUFFile(path)
    assert f.arch == "qwen4exp"
    plan = synth.tensor_plan(synth.LIKE["qwen4exp"], 4, 300, "Q8_0", experts=2, ngram_rows=4096)
    assert {n for n, *_ in plan} == set(f.tensors)
    rows = f.tensors["per_layer_token_embd.weight"].shape[0]
    assert 4096 - 16 * 64 < rows <= 4096
    engine = strata.load(path)
    c = engine.config
    assert c.recurrent == (True, True, True, False) and c.ple_layers == (1,) and c.hc_count == 4
    assert engine.model.ple_table.rows == rows
    out = engine.generate([280, 281, 282], max_new_tokens=2, stop_at_eos=False)
    assert len(out) == 2 and all(0 <= t < 300 for t in out)
    assert 0 < engine.model.ple_table.stats()["rows_read"] <= 16 * 5  # rows of 5 tokens, never the table


def test_llama_cpp_loads_it(q4km, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    nxt = synth.write(tmp_path / "next.gguf", like_name="qwen3-next-80b", layers=4, vocab=512, experts=16)
    for path, vocab in ((q4km, 1024), (nxt, 512)):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, verbose=False)
        assert llm.n_vocab() == vocab
        out = llm.create_completion("hello", max_tokens=3, temperature=0.0)
        assert isinstance(out["choices"][0]["text"], str)


def _tiny_likes():
    """Small configs of the two llama.cpp-loadable architectures, in synth's LIKE form (llama.cpp
    0.3.36's qwen3next needs equal DeltaNet key and value head widths, as the real model has)."""
    from dataclasses import replace

    from strata.formats import qwen3moe, qwen3next
    from strata.formats.hparams import RopeConfig

    common = dict(vocab_size=512, hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16, expert_ffn_size=32,
                  n_experts=8, n_experts_used=2, norm_topk_prob=True, rms_eps=1e-6, context_length=256)
    return {
        "tiny-qwen3moe": qwen3moe.Config(**common, n_layers=2, ffn_size=96, rope=RopeConfig(dim=16, theta=1e6)),
        "tiny-qwen3next": qwen3next.Config(
            **common, n_layers=4, ffn_size=96, shared_ffn_size=48, rope=RopeConfig(dim=8, theta=1e7),
            recurrent=(True, True, True, False), conv_kernel=4, linear_k_heads=2, linear_v_heads=4,
            linear_k_dim=16, linear_v_dim=16),
        # 4 hyper-connection streams, a QSA layer (12 tokens: within its budget, dense) and the
        # n-gram table on layer 1, as the real model
        "tiny-qwen4exp": replace(
            synth.LIKE["qwen4exp"], **{k: v for k, v in common.items() if k != "vocab_size"}, vocab_size=512,
            n_layers=4, shared_ffn_size=32, rope=RopeConfig(dim=8, theta=1e7), rope_sections=(2, 1, 1, 0),
            recurrent=(True, True, True, False), compress_ratios=(0, 0, 0, 4), linear_k_heads=2, linear_v_heads=4,
            linear_k_dim=16, linear_v_dim=16, hc_rank=16, indexer_heads=2, indexer_dim=16, indexer_budget=16,
            ple_row_dim=4, ple_rows=None),  # 16 hash heads of 4: the table is hidden_size wide, as the real one
    }


@pytest.mark.parametrize("like", ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen4exp"])
def test_synth_file_matches_llama_cpp(tmp_path, monkeypatch, like):
    """llama.cpp and Strata (float32 activations) compute the same logits on a synth file with F32
    weights. With 8-bit weights the two differ by about 0.3 on these random models, as llama.cpp
    differs from itself: it rounds activations to 8 bits for 8-bit weights (Strata's "q8" mode does
    the same and moves as far); random weights carry that rounding to the logits undamped."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from strata import kernels

    config = _tiny_likes()[like]
    monkeypatch.setitem(synth.LIKE, like, config)
    path = synth.write(tmp_path / "tiny.gguf", like_name=like, layers=config.n_layers, quant_name="F32",
                       ngram_rows=4096 if like == "tiny-qwen4exp" else None)
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[:len(ids)]), dtype=torch.float32)
    llm.close()
    mode = kernels.activations()
    kernels.set_activations("float32")
    try:
        engine = strata.load(path)
        with torch.inference_mode():
            ours = engine.model(torch.tensor([ids]), engine.model.new_cache(1))[0].float()
    finally:
        kernels.set_activations(mode)
    err = (ours - theirs).abs().max().item()
    spread = (theirs.max() - theirs.min()).item()
    assert err < 1e-3 * spread, f"{like}: max |logit difference| {err:.2e}, spread {spread:.2f}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_synth_says_when_a_hybrid_file_has_no_attention_layer_for_llama_cpp(tmp_path, capsys):
    """llama.cpp 0.3.36 aborts (GGML_ASSERT(buffer)) on a qwen3next file whose layers are all Gated
    DeltaNet: its KV cache has no layer. The file is valid and Strata runs it; synth says so."""
    assert synth.attention_free("qwen3-next-80b", 3) and not synth.attention_free("qwen3-next-80b", 4)
    assert synth.attention_free("qwen4exp", 1) and not synth.attention_free("qwen3-30b-a3b", 1)
    path = tmp_path / "next3.gguf"
    assert cli_main(["synth", "--like", "qwen3-next-80b", "--layers", "3", "--vocab", "512", "--experts", "4",
                     "--quant", "Q4_0", str(path)]) == 0
    assert "llama.cpp 0.3.36 aborts" in capsys.readouterr().out
    engine = strata.load(path, cpu_threads=1)
    assert len(engine.generate([1, 2, 3], 2, stop_at_eos=False)) == 2
    assert cli_main(["synth", "--like", "qwen3-next-80b", "--layers", "4", "--vocab", "512", "--experts", "4",
                     "--quant", "Q4_0", str(tmp_path / "next4.gguf")]) == 0
    assert "aborts" not in capsys.readouterr().out
