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
    assert m[f"{a}.embedding_length"] == like.hidden == 2048
    assert m[f"{a}.expert_count"] == like.experts == 128
    assert m[f"{a}.expert_used_count"] == like.experts_used == 8
    assert m[f"{a}.expert_feed_forward_length"] == like.expert_ffn == 768
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
    assert t["blk.0.ssm_in.weight"].shape == (2 * 16 * 128 + 2 * 32 * 128, 2048)
    assert t["blk.0.ssm_conv1d.weight"].shape == (2 * 16 * 128 + 32 * 128, 4)
    assert t["blk.3.attn_q.weight"].shape == (2 * 16 * 256, 2048)  # [query | gate] per head
    assert t["blk.3.attn_k.weight"].shape == (2 * 256, 2048)
    assert t["blk.0.ffn_gate_exps.weight"].shape == (16, 512, 2048)
    assert t["blk.0.ffn_down_shexp.weight"].shape == (2048, like.shared_ffn)
    assert "blk.0.attn_q.weight" not in t and "blk.3.ssm_in.weight" not in t
    plan = synth.tensor_plan(like, 4, 512, "Q8_0", experts=16)
    assert {n for n, *_ in plan} == set(t)


def test_qwen3_next_loads(tmp_path):
    path = synth.write(tmp_path / "next1.gguf", like_name="qwen3-next-80b", layers=1, vocab=512, experts=16,
                       quant_name="Q8_0")
    engine = strata.load(path)
    assert engine.config.recurrent == (True,)
    assert len(engine.generate([300, 301], max_new_tokens=2, stop_at_eos=False)) == 2


def test_refuses_unimplemented_and_unknown(tmp_path, capsys):
    with pytest.raises(StrataError, match="not implemented"):
        synth.write(tmp_path / "x.gguf", like_name="qwen4exp")
    assert not (tmp_path / "x.gguf").exists()
    assert cli_main(["synth", "--like", "qwen4exp", str(tmp_path / "y.gguf")]) == 2
    assert "not implemented" in capsys.readouterr().err
    for bad in (dict(quant_name="Q3_K_S"), dict(vocab=100), dict(like_name="llama-7b"), dict(experts=0)):
        with pytest.raises(StrataError):
            synth.write(tmp_path / "x.gguf", **bad)


def test_llama_cpp_loads_it(q4km, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    nxt = synth.write(tmp_path / "next.gguf", like_name="qwen3-next-80b", layers=4, vocab=512, experts=16)
    for path, vocab in ((q4km, 1024), (nxt, 512)):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, verbose=False)
        assert llm.n_vocab() == vocab
        out = llm.create_completion("hello", max_tokens=3, temperature=0.0)
        assert isinstance(out["choices"][0]["text"], str)
