"""qwen3next (Gated DeltaNet + gated attention, MoE with a shared expert) against transformers'
Qwen3NextForCausalLM: a tiny random model (both layer kinds, GQA in the DeltaNet, d_k != d_v,
partial rotary), fp32, CPU, with the shared runner's conventions.

Three files hold the same weights: the safetensors checkpoint, our converter's GGUF (legacy fused
`ssm_in`), and that GGUF rewritten in llama.cpp's current split layout (`attn_qkv` + `attn_gate`).
"""

from __future__ import annotations


import gguf
import pytest
import torch
from transformers import Qwen3NextForCausalLM

import strata
from reference import (batch_and_verify_logits, cached_engine, cached_hf_greedy, check_merge_and_leave, hf_logits, prompt,
                       qwen3next_config, randomise, save_hf)
from strata.gguf.convert import convert_hf_to_gguf
from strata.gguf.reader import GGUFFile
from strata.gguf.source import GGUFSource
from strata.gguf.writer import write_gguf
from strata.formats import qwen3next
from strata import kernels
from strata.kernels import decode_ops
from strata.models.gated_deltanet import (GDNCache, chunk_gated_delta_rule, recurrent_gated_delta_rule,
                                          split_ssm_in)

VOCAB = 256
F32 = gguf.GGMLQuantizationType.F32
FORMATS = ["safetensors", "gguf", "gguf-split"]


def tiny_qwen3next() -> Qwen3NextForCausalLM:
    model = Qwen3NextForCausalLM(qwen3next_config(VOCAB))
    randomise(model.eval())  # every parameter: zero-centred norms, A_log, dt_bias, conv weights too
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # decay rates from fast to slow, so state carried across chunks matters
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                a_log = layer.linear_attn.A_log
                a_log.copy_(torch.empty(a_log.shape).uniform_(0.02, 2.0, generator=g).log())
    return model


def write_split_layout(src, dst):
    """Rewrite a GGUF's fused `ssm_in` as llama.cpp's current `attn_qkv` + `attn_gate`."""
    file = GGUFFile(src)
    c = qwen3next.Config.from_gguf(file.metadata)
    source = GGUFSource(file)
    tensors = []
    for name in source.names():
        t = source.get(name).dequantize()
        if name.endswith(".ssm_in.weight"):
            qkv, z = split_ssm_in(t, c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim)
            tensors += [(name.replace("ssm_in", "attn_qkv"), qkv, F32),
                        (name.replace("ssm_in", "attn_gate"), z, F32)]
        else:
            tensors.append((name, t, F32))
    return write_gguf(dst, qwen3next.ARCH, file.metadata, tensors)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_qwen3next()
    d = tmp_path_factory.mktemp("qwen3next")
    save_hf(model, d / "hf")
    convert_hf_to_gguf(d / "hf", d / "model.gguf")
    write_split_layout(d / "model.gguf", d / "split.gguf")
    return model, {"safetensors": d / "hf", "gguf": d / "model.gguf", "gguf-split": d / "split.gguf"}


_greedy = cached_hf_greedy
_engine = cached_engine


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_and_greedy_match_transformers(checkpoint, fmt):
    ref_model, paths = checkpoint
    engine = _engine(paths[fmt])
    ids = prompt(VOCAB)
    diff = (engine.logits(ids) - hf_logits(ref_model, ids)).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff}"
    assert engine.generate(ids, max_new_tokens=32, stop_at_eos=False) == _greedy(ref_model, tuple(ids), 32)


def test_gguf_layout_follows_llama_cpp(checkpoint):
    ref_model, paths = checkpoint
    file = GGUFFile(paths["gguf"])
    meta, source = file.metadata, GGUFSource(file)
    a = qwen3next.ARCH
    assert file.arch == a
    assert (meta[f"{a}.full_attention_interval"], meta[f"{a}.rope.dimension_count"]) == (2, 8)
    assert (meta[f"{a}.ssm.conv_kernel"], meta[f"{a}.ssm.state_size"], meta[f"{a}.ssm.group_count"],
            meta[f"{a}.ssm.time_step_rank"], meta[f"{a}.ssm.inner_size"]) == (4, 16, 2, 4, 32)
    assert meta[f"{a}.expert_shared_feed_forward_length"] == 48

    def get(name):
        return source.get(name).dequantize()

    hf = dict(ref_model.named_parameters())
    la = "model.layers.0.linear_attn."
    torch.testing.assert_close(get("blk.0.ssm_a"), -hf[la + "A_log"].exp())
    torch.testing.assert_close(get("blk.0.ssm_dt.bias"), hf[la + "dt_bias"])
    torch.testing.assert_close(get("blk.0.ssm_norm.weight"), hf[la + "norm.weight"])  # not zero-centred
    torch.testing.assert_close(get("blk.0.ssm_conv1d.weight"), hf[la + "conv1d.weight"][:, 0])
    torch.testing.assert_close(get("blk.0.ssm_in.weight"), hf[la + "in_proj_qkvz.weight"])
    torch.testing.assert_close(get("blk.0.ssm_ba.weight"), hf[la + "in_proj_ba.weight"])
    torch.testing.assert_close(get("blk.0.attn_norm.weight"), 1 + hf["model.layers.0.input_layernorm.weight"])
    torch.testing.assert_close(get("blk.1.post_attention_norm.weight"),
                               1 + hf["model.layers.1.post_attention_layernorm.weight"])
    torch.testing.assert_close(get("blk.1.attn_q_norm.weight"), 1 + hf["model.layers.1.self_attn.q_norm.weight"])
    torch.testing.assert_close(get("blk.1.attn_q.weight"), hf["model.layers.1.self_attn.q_proj.weight"])
    torch.testing.assert_close(get("output_norm.weight"), 1 + hf["model.norm.weight"])
    assert source.get("blk.0.ffn_gate_inp_shexp.weight").shape == (1, 64)
    assert source.get("blk.0.ffn_gate_exps.weight").shape == (8, 32, 64)
    assert not any(n.startswith("blk.1.ssm") for n in source.names())  # layer 1 is full attention
    split = GGUFSource(GGUFFile(paths["gguf-split"]))
    assert split.get("blk.0.attn_qkv.weight").shape == (96, 64)
    assert split.get("blk.0.attn_gate.weight").shape == (32, 64)


@torch.inference_mode()
def hf_prefill_then_decode(model, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """transformers' own cached path: the chunked delta rule for the prompt, then the recurrence."""
    out = model(ids[:, :n_prefill], use_cache=True)
    logits, cache = [out.logits[0]], out.cache
    for i in range(n_prefill, ids.shape[1]):
        out = model(ids[:, i:i + 1], cache=cache, use_cache=True)
        logits.append(out.logits[0])
        cache = out.cache
    return torch.cat(logits).float()


def test_prefill_then_decode_equals_one_forward(checkpoint):
    """Decode steps (the recurrence, the rolling conv window) continue the prefill exactly.

    Against transformers' own prefill-then-decode the bound is 1e-4. Against one full forward
    it is relative to the logits' scale: transformers' two paths differ by about 1.3e-4 on this
    model (fp32 rounding of the chunked vs the token-by-token delta rule, amplified through the
    layers), so an absolute 1e-4 there would test rounding, not the cache."""
    ref_model, paths = checkpoint
    model = _engine(paths["gguf"]).model
    ids = torch.tensor([prompt(VOCAB, 64) + prompt(VOCAB, 16, seed=7)])
    with torch.inference_mode():
        whole = model(ids, model.new_cache(1))[0]
        cache = model.new_cache(1)
        steps = [model(ids[:, :64], cache)[0]]
        steps += [model(ids[:, i:i + 1], cache)[0] for i in range(64, ids.shape[1])]
    steps = torch.cat(steps)
    diff = (steps - hf_prefill_then_decode(ref_model, ids, 64)).abs().max().item()
    assert diff < 1e-4, diff
    assert (steps - whole).abs().max().item() < 5e-5 * whole.abs().max().item()
    assert torch.equal(steps.argmax(-1), whole.argmax(-1))


def test_prefill_in_chunks_equals_one_pass(checkpoint):
    _, paths = checkpoint
    ids = prompt(VOCAB)
    model = _engine(paths["gguf"]).model
    with torch.inference_mode():
        whole = model(torch.tensor([ids]), model.new_cache(1))[0]
        cache = model.new_cache(1)
        parts = [model(torch.tensor([ids[s:s + 7]]), cache)[0] for s in range(0, len(ids), 7)]
    # each against transformers, not against each other: two roundings of the same math differ by up
    # to twice the tolerance (1.09e-4 on an AVX2-only CPU, where both were within 7.3e-5 of it)
    ref = hf_logits(checkpoint[0], ids)
    assert (whole - ref).abs().max().item() < 1e-4
    assert (torch.cat(parts) - ref).abs().max().item() < 1e-4
    once = _engine(paths["gguf"]).generate(ids, 8, stop_at_eos=False)
    assert _engine(paths["gguf"], prefill_chunk=7).generate(ids, 8, stop_at_eos=False) == once


def test_batch_of_prompts_matches_one_by_one(checkpoint):
    ref_model, paths = checkpoint
    engine = _engine(paths["gguf"])
    prompts = [prompt(VOCAB, n, seed=n) for n in (64, 17, 40)]
    batched = engine.logits(prompts)
    for ids, got in zip(prompts, batched):
        assert (got - hf_logits(ref_model, ids)).abs().max().item() < 1e-4
    expected = [_greedy(ref_model, tuple(ids), 12) for ids in prompts]
    assert engine.generate(prompts, max_new_tokens=12, stop_at_eos=False) == expected
    # chunked prefill of rows of different lengths: later chunks hold no real token for short rows
    assert _engine(paths["gguf"], prefill_chunk=7).generate(prompts, 12, stop_at_eos=False) == expected


def _recurrent_caches(cache):
    return [c for c in cache.layers if isinstance(c, GDNCache)]


def test_padding_never_reaches_the_recurrent_state(checkpoint):
    _, paths = checkpoint
    model = _engine(paths["gguf"]).model
    prompts = [prompt(VOCAB, 64, seed=3), prompt(VOCAB, 5, seed=4), prompt(VOCAB, 30, seed=5)]
    tokens = torch.zeros(3, 64, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = torch.tensor(p)
    with torch.inference_mode():
        batch = model.new_cache(3)
        model(tokens, batch, n_new=torch.tensor([len(p) for p in prompts]))
        for row, p in enumerate(prompts):
            alone = model.new_cache(1)
            model(torch.tensor([p]), alone)
            for b, a in zip(_recurrent_caches(batch), _recurrent_caches(alone)):
                torch.testing.assert_close(b.conv[row], a.conv[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(b.state[row], a.state[0], atol=1e-5, rtol=1e-5)


def test_recurrent_cache_select_extend_and_size(checkpoint):
    """Continuous batching: requests prefilled alone, merged, decoded together, then one leaves."""
    _, paths = checkpoint
    model = _engine(paths["gguf"]).model
    prompts = [prompt(VOCAB, 20, seed=8), prompt(VOCAB, 33, seed=9)]

    def inspect(merged):
        gdn = _recurrent_caches(merged)[0]
        assert gdn.nbytes == 2 * (3 * 96 + 4 * 16 * 8) * 4  # conv window + fp32 state, per row

    check_merge_and_leave(model, prompts, inspect)


QWEN3_NEXT_80B_CONFIG = {  # config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (no layer_types)
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_scaling": None, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "tie_word_embeddings": False}


def test_config_round_trips_through_gguf_metadata():
    c = qwen3next.Config.from_hf(QWEN3_NEXT_80B_CONFIG)
    assert c.recurrent == tuple((i + 1) % 4 != 0 for i in range(48)) and c.rope.dim == 64
    assert c.dense_layers == () and c.rope.theta == 1e7
    assert qwen3next.Config.from_gguf(qwen3next.gguf_metadata(c)) == c


def test_mtp_weights_in_a_checkpoint_are_ignored(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import save_file

    ref_model, paths = checkpoint
    shutil.copytree(paths["safetensors"], tmp_path / "hf")
    save_file({"mtp.fc.weight": torch.zeros(64, 128)}, str(tmp_path / "hf" / "mtp.safetensors"))
    ids = prompt(VOCAB, 16)
    assert (strata.load(tmp_path / "hf").logits(ids) - hf_logits(ref_model, ids)).abs().max().item() < 1e-4


def test_chunked_and_recurrent_delta_rule_agree():
    g = torch.Generator().manual_seed(0)
    b, h, t, dk, dv = 2, 3, 21, 8, 5
    q, k = torch.randn(b, h, t, dk, generator=g), torch.randn(b, h, t, dk, generator=g)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(b, h, t, dv, generator=g)
    decay = -torch.rand(b, h, t, generator=g)
    beta = torch.rand(b, h, t, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    for chunk in (4, 8, 64):
        out, new_state = chunk_gated_delta_rule(q, k, v, decay, beta, state, chunk)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_state, ref_state, atol=1e-5, rtol=1e-5)
    # value heads sharing key heads (3 per key head): the chunked form takes q, k per key head
    v3, decay3, beta3, state3 = (u.repeat_interleave(3, dim=1) for u in (v, decay, beta, state))
    v3 = v3 + torch.randn(v3.shape, generator=g)
    decay3, beta3 = decay3 * torch.rand(decay3.shape, generator=g), beta3.flip(-1)
    ref_out, ref_state = recurrent_gated_delta_rule(q.repeat_interleave(3, dim=1), k.repeat_interleave(3, dim=1),
                                                    v3, decay3, beta3, state3)
    out, new_state = chunk_gated_delta_rule(q, k, v3, decay3, beta3, state3, 8)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, ref_state, atol=1e-5, rtol=1e-5)
    # decays strong enough that exp(G) underflows float32 within a chunk (the dropped factors are
    # zero, not subnormal): still the float64 recurrence
    strong = decay3 * 60
    ref_out, ref_state = recurrent_gated_delta_rule(*(u.double() for u in (
        q.repeat_interleave(3, dim=1), k.repeat_interleave(3, dim=1), v3, strong, beta3, state3)))
    out, new_state = chunk_gated_delta_rule(q, k, v3, strong, beta3, state3, 8)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state.double(), ref_state, atol=1e-5, rtol=1e-5)


def test_short_prompt_pads_to_a_multiple_of_8_not_a_chunk(monkeypatch):
    """A prompt shorter than a chunk pads to a multiple of 8 (an 8-token prompt padded to 64 cost 8x
    the products); the result is the 64-chunk one."""
    from strata.models import gated_deltanet

    g = torch.Generator().manual_seed(1)
    b, t, hk, hv, dk, dv = 1, 5, 2, 4, 8, 8
    q, k = torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g)
    v = torch.randn(b, t, hv, dv, generator=g)
    decay, beta = -torch.rand(b, t, hv, generator=g), torch.rand(b, t, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    chunks, chunked = [], gated_deltanet.chunk_gated_delta_rule

    def spy(*a):
        chunks.append(a[-1])
        return chunked(*a)

    monkeypatch.setattr(gated_deltanet, "chunk_gated_delta_rule", spy)
    out, new_state = gated_deltanet.gated_delta_rule(q, k, v, decay, beta, state, 64)
    assert chunks == [8]
    scale = dk ** -0.5
    qh, kh, vh, gh, bh = (u.transpose(1, 2).float() for u in (q, k, v, decay, beta))
    ref_out, ref_state = chunked(gated_deltanet.l2norm(qh, scale=scale), gated_deltanet.l2norm(kh), vh, gh, bh,
                                 state, 64)
    torch.testing.assert_close(out, ref_out.transpose(1, 2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_state, ref_state, atol=1e-6, rtol=1e-6)


def _q8_file_and_reference(checkpoint, tmp_path):
    """The tiny model as a Q8_0 file, and transformers' model given the same weights through
    gguf-py's quantize and dequantize (whole-block matrices but norms, routers, experts)."""
    import copy

    import gguf.quants

    ref_model, paths = checkpoint
    q8 = gguf.GGMLQuantizationType.Q8_0
    convert_hf_to_gguf(paths["safetensors"], tmp_path / "q8.gguf", dense_type=q8)
    ref = copy.deepcopy(ref_model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 2 and p.shape[-1] % 32 == 0 and "experts" not in name and "shared_expert_gate" not in name \
                    and not name.endswith("mlp.gate.weight"):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)))
    return tmp_path / "q8.gguf", ref


def _count_halves(monkeypatch, names):
    calls = dict.fromkeys(names, 0)
    for name in calls:
        def counted(*a, _fn=getattr(decode_ops, name), _name=name):
            y = _fn(*a)
            calls[_name] += y is not None
            return y
        monkeypatch.setattr(decode_ops, name, counted)
    return calls


@pytest.fixture
def float_activations():
    before = kernels.activations()
    kernels.set_activations("float32")
    yield
    kernels.set_activations(before)


def test_quantized_decode_layer_halves_match_transformers(checkpoint, tmp_path, monkeypatch, float_activations):
    """A Q8_0 file of the tiny model decodes through the one-call C layer halves (DeltaNet:
    strata_gdn_decode; gated attention: strata_attn_decode with its output gate), float32
    activations, and matches transformers' own prefill-then-decode given the same weights through
    gguf-py's quantize and dequantize (the DeltaNet state and conv window carried from the prompt)."""
    path, ref = _q8_file_and_reference(checkpoint, tmp_path)
    calls = _count_halves(monkeypatch, ("try_gdn_block", "try_attention_block"))
    ids = torch.tensor([prompt(VOCAB, 24) + prompt(VOCAB, 8, seed=7)])
    model = strata.load(path, draft="off").model
    with torch.inference_mode():
        cache = model.new_cache(1)
        steps = [model(ids[:, :24], cache)[0]]
        steps += [model(ids[:, i:i + 1], cache)[0] for i in range(24, ids.shape[1])]
    assert calls == {"try_gdn_block": 2 * 8, "try_attention_block": 2 * 8}  # 2 layers of each kind, 8 steps
    diff = (torch.cat(steps[1:]) - hf_prefill_then_decode(ref, ids, 24)[24:]).abs().max().item()
    assert diff < 1e-4, diff  # 3.9e-5 (the torch modules: 4.0e-5), max |logit| 8.5


def test_quantized_batch_and_verify_passes_match_transformers(checkpoint, tmp_path, monkeypatch, float_activations):
    """Two sequences of a Q8_0 file decoded as one batch, with a speculative verify pass between
    (tracked, right-padded: 3 and 2 positions; row 0 then drops 1), the DeltaNet layers in one C
    call per pass: every position's logits against transformers' prefill-then-decode of each
    sequence alone, and the decode after the rollback continues from the kept tokens' state."""
    path, ref = _q8_file_and_reference(checkpoint, tmp_path)
    calls = _count_halves(monkeypatch, ("try_gdn_block",))
    seqs = [prompt(VOCAB, 24) + prompt(VOCAB, 6, seed=7), prompt(VOCAB, 17, seed=3) + prompt(VOCAB, 6, seed=9)]
    got = batch_and_verify_logits(strata.load(path, draft="off").model, seqs, [24, 17])
    assert calls["try_gdn_block"] == 2 * 5  # 2 DeltaNet layers, 5 passes (the prompt: the chunked form)
    for r in range(2):
        want = hf_prefill_then_decode(ref, torch.tensor([seqs[r]]), [24, 17][r])
        diff = max((logits - want[p]).abs().max().item() for p, logits in got[r])
        assert diff < 1e-4, (r, diff)


