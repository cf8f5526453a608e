"""Every architecture against transformers' own class: tiny random configs, fp32, CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

import strata
from strata import kernels
from strata.gguf.convert import convert_hf_to_gguf
from reference import gguf_roundtrip, hf_greedy, hf_logits, prompt, randomise, save_hf

VOCAB = 256


def llama():
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32},
        tie_word_embeddings=True))


def mixtral():
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512))


def qwen3moe():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512))


def qwen3moe_unnormalised():
    m = qwen3moe()
    m.config.norm_topk_prob = False
    for layer in m.model.layers:
        layer.mlp.gate.norm_topk_prob = False
    return m


BUILDERS = {"llama": llama, "mixtral": mixtral, "qwen3moe": qwen3moe,
            "qwen3moe-unnormalised": qwen3moe_unnormalised}


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    model = randomise(BUILDERS[request.param]().eval())
    d = tmp_path_factory.mktemp(request.param)
    save_hf(model, d / "hf")
    convert_hf_to_gguf(d / "hf", d / "model.gguf")
    return model, {"safetensors": d / "hf", "gguf": d / "model.gguf"}


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_logits_and_greedy_match_transformers(checkpoint, fmt):
    ref_model, paths = checkpoint
    engine = strata.load(paths[fmt])
    ids = prompt(VOCAB)
    diff = (engine.logits(ids) - hf_logits(ref_model, ids)).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff}"
    assert engine.generate(ids, max_new_tokens=32, stop_at_eos=False) == hf_greedy(ref_model, ids, 32)


def test_batch_of_prompts_matches_one_by_one(checkpoint):
    ref_model, paths = checkpoint
    engine = strata.load(paths["gguf"])
    prompts = [prompt(VOCAB, n, seed=n) for n in (64, 17, 40)]
    batched = engine.logits(prompts)
    for ids, got in zip(prompts, batched):
        assert (got - hf_logits(ref_model, ids)).abs().max().item() < 1e-4
    outs = engine.generate(prompts, max_new_tokens=12, stop_at_eos=False)
    assert outs == [hf_greedy(ref_model, ids, 12) for ids in prompts]


def test_prefill_in_chunks_equals_one_pass(checkpoint):
    _, paths = checkpoint
    ids = prompt(VOCAB)
    whole = strata.load(paths["gguf"]).generate(ids, 8, stop_at_eos=False)
    chunked = strata.load(paths["gguf"], prefill_chunk=7).generate(ids, 8, stop_at_eos=False)
    assert whole == chunked


@pytest.mark.parametrize("dense, experts", [("Q8_0", "Q4_0"), ("Q5_1", "Q8_0")])
def test_quantized_gguf_matches_transformers_with_gguf_py_dequantized_weights(tmp_path, monkeypatch, dense, experts):
    """Quantized storage end to end: the reference gets the same weights through gguf-py's numpy
    quantize/dequantize, so only Strata's own path (bytes -> dequant -> compute) is under test."""
    from gguf import GGMLQuantizationType as Q

    torch.manual_seed(0)
    model = randomise(qwen3moe().eval())
    save_hf(model, tmp_path / "hf")
    convert_hf_to_gguf(tmp_path / "hf", tmp_path / "q.gguf", dense_type=Q[dense], expert_type=Q[experts])
    ref = gguf_roundtrip(model, Q[dense], Q[experts])
    ids = prompt(VOCAB)
    want = hf_logits(ref, ids)
    engine = strata.load(tmp_path / "q.gguf")
    fast = engine.logits(ids)  # the quantized CPU kernels (int16 activations where they apply)
    monkeypatch.setattr(kernels, "USE_KERNELS", False)
    exact = engine.logits(ids)  # the reference path: dequantize, then multiply
    assert (exact - want).abs().max().item() < 1e-4
    assert (fast - want).abs().max().item() < 2e-3
    assert torch.equal(fast.argmax(-1), want.argmax(-1))
