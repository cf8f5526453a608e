"""bf16 and fp16 on every architecture: logits against the same file run in float32.

Two kinds of model:
- the bundled demo (a trained qwen4exp with its MTP head): its logits are decisive, as a real
  model's are, so bf16 must agree with float32 on >= 95 % of top-1 tokens over a random prompt,
  and greedy generation with tiers and drafts on must give float32's tokens;
- tiny random models of each architecture (norms randomised around their init, MoE routing like the
  real models: 32 experts, top-8). Random weights put many logits and router scores within bf16's
  rounding (2^-8) of each other, so a near-tie flips and changes everything after it; transformers'
  own bf16 flips as many. There, fp16 (10-bit mantissa) must agree on >= 95 %, and bf16 must be as
  close to float32 as transformers' bf16 is to transformers' float32 on the same checkpoint (within
  one token in 16); relative logit error (L2) under 5 % (fp16) and 15 % (bf16).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM, Qwen4ExpForCausalLM,
                          Qwen4ExpTextConfig)

import strata
from reference import hf_logits, prompt, randomise, save_hf
from strata.gguf.convert import convert_hf_to_gguf

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 256
DEMO = "strata/demo/strata-demo.gguf"
MOE = dict(num_experts_per_tok=8)


def _llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))


def _mixtral():
    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=32,
                                            max_position_embeddings=512, **MOE))


def _qwen3moe():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                              moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16, num_experts=32, norm_topk_prob=True,
                                              max_position_embeddings=512, **MOE))


def _qwen3next():
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=32, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, **MOE))


def _qwen4exp():
    from test_qwen4exp import CONFIG

    return Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**{**CONFIG, "num_hidden_layers": 4, "num_experts": 32, **MOE}))


BUILDERS = {"llama": _llama, "mixtral": _mixtral, "qwen3moe": _qwen3moe, "qwen3next": _qwen3next,
            "qwen4exp": _qwen4exp}


def _near_init_norms(model, spread: float = 0.1):
    """Norm weights random around their init (1, or 0 for zero-centred norms), not left at it."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                centre = 0.0 if p.abs().mean() < 0.5 else 1.0
                p.copy_(centre + spread * torch.randn(p.shape, generator=g))
    return model


def tiny_checkpoint(arch: str, tmp_path_factory):
    """(transformers model, its GGUF path): a tiny random `arch` with random norms, converted."""
    torch.manual_seed(0)
    model = _near_init_norms(randomise(BUILDERS[arch]().eval()))
    d = tmp_path_factory.mktemp(arch)
    save_hf(model, d / "hf")
    convert_hf_to_gguf(d / "hf", d / "model.gguf")
    return model, d / "model.gguf"


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return request.param, *tiny_checkpoint(request.param, tmp_path_factory)


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm()).item()


def test_half_precision_logits_close_to_float32(checkpoint):
    name, ref_model, path = checkpoint
    ids = prompt(VOCAB)
    f32 = strata.load(path).logits(ids).float()
    f16 = strata.load(path, dtype="float16").logits(ids).float()
    bf16 = strata.load(path, dtype="bfloat16").logits(ids).float()
    hf32 = hf_logits(ref_model, ids)
    hf_bf16 = hf_logits(copy.deepcopy(ref_model).to(torch.bfloat16), ids)
    assert (f32 - hf32).abs().max().item() < 1e-4  # the float32 baseline is transformers'
    a16, abf, ahf = _agreement(f16, f32), _agreement(bf16, f32), _agreement(hf_bf16, hf32)
    msg = f"{name}: top-1 agreement fp16 {a16:.3f}, bf16 {abf:.3f} (transformers' bf16 {ahf:.3f})"
    assert a16 >= 0.95, msg
    assert abf >= ahf - 1 / 16, msg
    msg += f"; relative L2 error fp16 {_rel(f16, f32):.4f}, bf16 {_rel(bf16, f32):.4f}"
    print(msg)
    assert _rel(f16, f32) < 0.05 and _rel(bf16, f32) < 0.15, msg


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_trained_model_half_precision_top1_and_generation_with_tiers_and_drafts(dtype):
    """The demo (qwen4exp + MTP head): >= 95 % top-1 agreement on a random prompt, and greedy
    tokens equal float32's with the tiered expert runtime (30 % cache) and MTP drafts on."""
    g = torch.Generator().manual_seed(1)
    f32 = strata.load(DEMO, draft="off")
    ids = torch.randint(0, f32.config.vocab_size, (96,), generator=g).tolist()
    half = strata.load(DEMO, dtype=dtype, draft="off")
    agree = _agreement(half.logits(ids).float(), f32.logits(ids).float())
    assert agree >= 0.95, f"{dtype}: top-1 agreement {agree:.3f}"
    text = list(range(40, 72))
    want = f32.generate(text, 12, stop_at_eos=False)
    tiered = strata.load(DEMO, dtype=dtype, draft="on", pin_experts="ram", experts_cache="30%")
    assert tiered.generate(text, 12, stop_at_eos=False) == want
    assert tiered.stats["draft"]["rounds"] > 0 and "tiers" in tiered.stats
