"""A decode token through all layers in one C call (kernels/decode_stack.py) against transformers and
against the block-by-block path it replaces."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import strata
from strata import kernels
from strata.gguf.convert import convert_hf_to_gguf
from strata.kernels import _build, decode_stack
from reference import gguf_roundtrip, hf_logits, prompt, qwen3next_config, randomise, save_hf

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {_build.error()}")
VOCAB = 256


def llama():  # llama3 rope factors, tied head; sizes the 32-wide blocks divide
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        tie_word_embeddings=True))


def qwen3moe():  # per-head q/k norms, NEOX rope, unnormalised top-k, one dense layer
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=False, mlp_only_layers=[1], max_position_embeddings=512))


BUILDERS = {"llama": llama, "qwen3moe": qwen3moe}
REAL_TRY_DECODE = decode_stack.try_decode


def _quantized(name: str, tmp_path, monkeypatch):
    """(the engine's model of a Q8_0 / Q5_1 GGUF of a randomised tiny model, transformers' model with
    the same weights through gguf-py's quantize + dequantize)."""
    from gguf import GGMLQuantizationType as Q

    torch.manual_seed(0)
    model = randomise(BUILDERS[name]().eval(), seed=3)
    if name == "qwen3moe":
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "norm_topk_prob"):
                layer.mlp.gate.norm_topk_prob = False
    save_hf(model, tmp_path / "hf")
    convert_hf_to_gguf(tmp_path / "hf", tmp_path / "q.gguf", dense_type=Q.Q8_0, expert_type=Q.Q5_1)
    return strata.load(tmp_path / "q.gguf").model, gguf_roundtrip(model, Q.Q8_0, Q.Q5_1)


def _counted(monkeypatch):
    """calls[0]: tokens the stack ran; calls[1]: of them, from the embedding row to the logits
    (strata_decode_token: the embedding, layers and head in one call)."""
    calls = [0, 0]

    def counted(*a):
        y = REAL_TRY_DECODE(*a)
        calls[0] += y is not None
        calls[1] += y is not None and len(a) > 5 and a[5] is not None
        return y

    monkeypatch.setattr(decode_stack, "try_decode", counted)
    return calls


@torch.inference_mode()
def _decode(model, ids: list[int], n_prompt: int) -> torch.Tensor:
    """Logits of ids[n_prompt - 1:] with ids[:n_prompt] as one prompt, then one token per step."""
    cache = model.new_cache(1)
    out = [model(torch.tensor([ids[:n_prompt]]), cache, last_only=True)[0]]
    for t in ids[n_prompt:]:
        out.append(model(torch.tensor([[t]]), cache, last_only=True)[0])
    return torch.cat(out)


@pytest.fixture
def activations():
    before = kernels.activations()
    yield kernels.set_activations
    kernels.set_activations(before)


@needs_kernels
@pytest.mark.parametrize("name,mode", [("llama", "int16"), ("qwen3moe", "int16"), ("qwen3moe", "q8x2")])
def test_stack_decode_matches_transformers_and_the_block_path(name, mode, tmp_path, monkeypatch, activations):
    """14 prompt tokens, then 10 decode steps (the KV cache grows from 16 to 32 positions on the
    way, so the layers' cache pointers are refreshed): every step's logits within 2e-3 of
    transformers on the same dequantized weights (the 8-bit activations' rounding; argmax equal),
    and equal, bit for bit, to the blocks called one by one (the same halves in the same order)."""
    activations(mode)  # the suite's int16, and the 8-bit default of a real run
    model, ref = _quantized(name, tmp_path, monkeypatch)
    ids = prompt(VOCAB, 24, seed=5)
    want = hf_logits(ref, ids)[13:]
    calls = _counted(monkeypatch)
    fast = _decode(model, ids, 14)
    assert calls == [10, 10]  # (a Q8_0 embedding: each token from its row to its logits in one call)
    assert (fast - want).abs().max().item() < 2e-3
    assert torch.equal(fast.argmax(-1), want.argmax(-1))
    monkeypatch.setattr(decode_stack, "try_decode", lambda *a: None)
    blocks = _decode(model, ids, 14)
    assert torch.equal(fast, blocks)
    monkeypatch.setattr(kernels, "USE_KERNELS", False)  # the reference path: dequantize, then multiply
    exact = _decode(model, ids, 14)
    assert (exact - want).abs().max().item() < 1e-4


@needs_kernels
def test_stack_is_rebuilt_when_a_weight_changes(tmp_path, monkeypatch):
    """A replaced output projection, and another activation mode, are picked up on the next step:
    the one-call stack is built from the present modules, not the ones it first saw."""
    from strata.models.linear import Linear

    model, _ = _quantized("llama", tmp_path, monkeypatch)
    ids = prompt(VOCAB, 20, seed=6)
    before = _decode(model, ids, 16)
    attn = model.blocks[1].attn
    w = copy.deepcopy(attn.wo.weight)
    half = w.raw.shape[0] // 2
    w.raw[:half] = w.raw.flip(0)[:half].clone()  # other rows: other products
    attn.wo = Linear(w)
    calls = _counted(monkeypatch)
    changed = _decode(model, ids, 16)
    assert calls[0] == 4 and not torch.equal(before[1:], changed[1:])
    monkeypatch.setattr(decode_stack, "try_decode", lambda *a: None)
    assert torch.equal(changed, _decode(model, ids, 16))
    mode = kernels.activations()
    try:
        kernels.set_activations("float32")
        calls = _counted(monkeypatch)
        f32 = _decode(model, ids, 16)
        assert calls[0] == 4 and not torch.equal(f32, changed)
        monkeypatch.setattr(decode_stack, "try_decode", lambda *a: None)
        assert torch.equal(f32, _decode(model, ids, 16))
    finally:
        kernels.set_activations(mode)


@needs_kernels
def test_token_ends_follow_the_model(tmp_path, monkeypatch):
    """The one-call token's embedding and head are the model's present ones: an output head with
    its rows permuted gives the same logits permuted, bit for bit; a float embedding table (looked
    up in Python, the layers and head still in C) gives the quantized table's logits; a float head
    (torch's norm and product) agrees to float32 rounding."""
    from strata.models.linear import Embedding, Linear

    model, _ = _quantized("llama", tmp_path, monkeypatch)
    ids = prompt(VOCAB, 20, seed=9)
    before = _decode(model, ids, 16)
    head = model.output.weight
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    w = copy.deepcopy(head)
    w.raw = w.raw[perm].contiguous()
    model.output = Linear(w)
    calls = _counted(monkeypatch)
    permuted = _decode(model, ids, 16)
    assert calls == [4, 4] and torch.equal(permuted, before[:, perm])
    model.output = Linear(head)
    model.tok_embd = Embedding(model.tok_embd.weight.dequantize(torch.float32))
    calls = _counted(monkeypatch)
    assert torch.equal(_decode(model, ids, 16), before) and calls == [4, 0]
    model.output = Linear(head.dequantize(torch.float32))
    calls = _counted(monkeypatch)
    floats = _decode(model, ids, 16)
    assert calls == [4, 0] and (floats - before).abs().max().item() < 1e-4 * before.abs().max().item()


@needs_kernels
def test_one_call_token_rotations_are_the_ropes_own(tmp_path, monkeypatch):
    """The one-call token's rotary tables: row p is what `rope.cos_sin` gives position p alone
    (what the blocks rotate by), across the tables' growth, and a replaced rope is picked up."""
    import dataclasses

    from strata.models.rope import Rope

    model, _ = _quantized("llama", tmp_path, monkeypatch)
    for pos in (0, 63, 64, 65, 200, 130, 7):
        cos, sin = model._rope_rows(pos)
        c, s = model.rope.cos_sin(torch.tensor([[pos]]))
        assert cos.shape[0] > pos and torch.equal(cos[pos], c.reshape(-1)) and torch.equal(sin[pos], s.reshape(-1))
    model.rope = Rope(dataclasses.replace(model.rope.cfg, theta=model.rope.cfg.theta * 3))
    c, _ = model.rope.cos_sin(torch.tensor([[5]]))
    assert torch.equal(model._rope_rows(5)[0][5], c.reshape(-1))


@needs_kernels
def test_two_threads_decoding_one_model_get_what_each_gets_alone(tmp_path, monkeypatch):
    """The stack's layer descriptions (KV pointers, scratch) serve one call at a time; a second
    thread decoding the same model meanwhile takes the block path, with the same results."""
    import threading

    model, _ = _quantized("llama", tmp_path, monkeypatch)
    seqs = [prompt(VOCAB, 30, seed=s) for s in (7, 8)]
    alone = [_decode(model, ids, 6) for ids in seqs]
    got, errors = [None, None], []

    def run(i):
        try:
            for _ in range(3):
                got[i] = _decode(model, seqs[i], 6)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(torch.equal(a, b) for a, b in zip(alone, got))


@needs_kernels
def test_stack_declines_what_it_cannot_take(tmp_path, monkeypatch):
    """A prompt, a tap, kernels off: the blocks run one by one (the C call never made)."""
    model, _ = _quantized("llama", tmp_path, monkeypatch)
    called = []
    monkeypatch.setattr(decode_stack, "try_decode", lambda *a: called.append(1))
    with torch.inference_mode():
        cache = model.new_cache(1)
        model(torch.tensor([prompt(VOCAB, 5)]), cache)
        model(torch.tensor([[3]]), cache, tap=lambda name, t: None)
    assert called == []


@needs_kernels
def test_layer_description_has_the_c_struct_size():
    """decode_stack.Layer mirrors decode_stack.c's strata_layer: a field added to one side only would
    shift every field after it (the C side reports its size for this check)."""
    import ctypes

    size = _build.entry("strata_layer_size", (), ctypes.c_int64)
    assert size is not None and size() == ctypes.sizeof(decode_stack.Layer)


@needs_kernels
@pytest.mark.parametrize("mode", ["int16", "q8x2"])
def test_stack_moe_with_a_gated_shared_expert_matches_the_torch_modules(mode, tmp_path, monkeypatch, activations):
    """A MoE layer with a sigmoid-gated shared expert (the stack's sh_gate / ffn_rows fields; no
    llama or qwen3moe file has one, so it is put in by hand: the dense layer's FFN as the shared
    expert of both MoE layers): the one-call stack equals the blocks one by one bit for bit, and
    the torch modules (MoE.forward + SharedExpert.forward, kernels off) within the 8-bit rounding."""
    from strata.models.layers import SharedExpert
    from strata.models.transformer import MoE, _c_route

    activations(mode)
    model, _ = _quantized("qwen3moe", tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(4)
    dense = model.blocks[1].ffn
    for i in (0, 2):
        moe = model.blocks[i].ffn
        assert type(moe) is MoE and moe.shared is None
        shared = SharedExpert.__new__(SharedExpert)
        torch.nn.Module.__init__(shared)
        shared.ffn = dense
        shared.gate = torch.randn(1, dense.gate.weight.shape[1], generator=g) / 4
        moe.shared = shared
        moe.c_route = _c_route(moe)
        assert moe.c_route is not None
    ids = prompt(VOCAB, 20, seed=9)
    calls = _counted(monkeypatch)
    fast = _decode(model, ids, 14)
    assert calls[0] == 6
    monkeypatch.setattr(decode_stack, "try_decode", lambda *a: None)
    assert torch.equal(fast, _decode(model, ids, 14))
    monkeypatch.setattr(kernels, "USE_KERNELS", False)
    exact = _decode(model, ids, 14)
    assert (fast - exact).abs().max().item() < 2e-3
    assert torch.equal(fast.argmax(-1), exact.argmax(-1))


def qwen3next():  # Gated DeltaNet layers (GQA, d_k != d_v) and gated full attention, MoE + gated shared expert
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(qwen3next_config(VOCAB, shared_expert_intermediate_size=64))


@pytest.fixture(scope="module")
def qwen3next_q8(tmp_path_factory):
    """(a Q8_0 file of a randomised tiny Qwen3-Next, norms included; transformers' model given the
    same weights through gguf-py's quantize + dequantize: the matrices, the experts' included, but
    the routers and the shared expert's gate row)."""
    import gguf.quants
    from gguf import GGMLQuantizationType as Q

    torch.manual_seed(0)
    model = randomise(qwen3next().eval(), seed=11)
    d = tmp_path_factory.mktemp("qwen3next")
    save_hf(model, d / "hf")
    convert_hf_to_gguf(d / "hf", d / "q8.gguf", dense_type=Q.Q8_0, expert_type=Q.Q8_0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and p.shape[-1] % 32 == 0 and "shared_expert_gate" not in name \
                    and not name.endswith("mlp.gate.weight"):
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), Q.Q8_0), Q.Q8_0)))
    return d / "q8.gguf", model


@needs_kernels
@pytest.mark.parametrize("mode", ["float32", "int16", "q8x2"])
def test_stack_decodes_qwen3next_like_transformers_and_the_block_path(mode, qwen3next_q8, monkeypatch, activations):
    """Qwen3-Next's DeltaNet layers (state and conv window stepped in place), gated attention
    layers and MoE layers with a sigmoid-gated shared expert in the one-call stack: 14 prompt
    tokens then 10 decode steps, twice on two caches in turn (so the DeltaNet and KV pointers are
    refreshed between requests): each step's logits equal, bit for bit, the blocks called one by
    one, and match transformers on the same dequantized weights (float32 activations: within 2e-4;
    the 8-bit ones: within their rounding, argmax equal)."""
    activations(mode)
    path, ref = qwen3next_q8
    model = strata.load(path, draft="off").model
    seqs = [prompt(VOCAB, 24, seed=5), prompt(VOCAB, 24, seed=6)]
    calls = _counted(monkeypatch)
    fast = [_decode(model, ids, 14) for ids in seqs]
    again = _decode(model, seqs[0], 14)  # a third cache after the second
    assert calls[0] == 30
    assert torch.equal(again, fast[0])
    monkeypatch.setattr(decode_stack, "try_decode", lambda *a: None)
    for ids, got in zip(seqs, fast):
        assert torch.equal(got, _decode(model, ids, 14))
        want = hf_logits(ref, ids)[13:]
        diff = (got - want).abs().max().item()
        # float32: 3.7e-5 and 9.1e-5 (the torch modules, kernels off: 2.3e-5, 6.0e-5; transformers'
        # full forward takes the chunked delta rule); 8-bit: 3.7e-3 to 1.2e-2; max |logit| 8.4
        assert diff < (2e-4 if mode == "float32" else 2e-2), diff
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_kernels
def test_stack_starts_the_deltanet_state_of_a_one_token_prompt(qwen3next_q8, monkeypatch):
    """A one-token prompt is the stack's first step on a fresh cache (no DeltaNet state yet: the
    stack makes it), after a request whose caches are gone (the layers' references to its tensors
    are dead): its logits equal the blocks', bit for bit."""
    path, _ = qwen3next_q8
    model = strata.load(path, draft="off").model
    ids = prompt(VOCAB, 8, seed=7)
    calls = _counted(monkeypatch)
    _decode(model, ids, 4)
    fast = _decode(model, ids, 1)
    assert calls[0] == 4 + 8
    monkeypatch.setattr(decode_stack, "try_decode", lambda *a: None)
    assert torch.equal(fast, _decode(model, ids, 1))


@needs_kernels
def test_stack_leaves_qwen3next_batches_and_verify_passes_to_the_blocks(qwen3next_q8, monkeypatch):
    """Two rows, or a tracked (speculative) cache: the stack is not run, and the DeltaNet layers'
    per-block C half is (what a verify pass's rollback reads stays its own)."""
    from strata.models.gated_deltanet import GDNCache

    path, _ = qwen3next_q8
    model = strata.load(path, draft="off").model
    calls = _counted(monkeypatch)
    with torch.inference_mode():
        cache = model.new_cache(2)
        model(torch.tensor([prompt(VOCAB, 6), prompt(VOCAB, 6, seed=2)]), cache)
        model(torch.tensor([[3], [4]]), cache)
        one = model.new_cache(1)
        model(torch.tensor([prompt(VOCAB, 6)]), one)
        for c in one.layers:
            if type(c) is GDNCache:
                c.track()
        model(torch.tensor([[3]]), one)
        assert all(c.pending is not None for c in one.layers if type(c) is GDNCache)
    assert calls[0] == 0


@needs_kernels
@pytest.mark.parametrize("layer,field,half", [(2, "gdn_rows", 0), (1, "k", 1), (2, "k", 1)])
def test_a_failed_half_leaves_the_rest_to_the_blocks(layer, field, half, qwen3next_q8, monkeypatch):
    """A layer half that fails in the stack (here made to: shapes that do not chain, or no experts
    to pick, as a half that found no memory stops) hands back where it stopped, and the blocks run
    the rest: a DeltaNet mixer's failure from that layer, an FFN's from that layer's FFN half (its
    mixer's state stepped once, not twice). The logits equal the blocks' path, bit for bit."""
    path, _ = qwen3next_q8
    model = strata.load(path, draft="off").model
    ids = prompt(VOCAB, 20, seed=12)
    monkeypatch.setattr(decode_stack, "try_decode", lambda *a: None)
    want = _decode(model, ids, 14)
    monkeypatch.setattr(decode_stack, "try_decode", REAL_TRY_DECODE)
    assert torch.equal(_decode(model, ids, 14), want)  # (builds the stack)
    lay = model._c_stack.layers[layer]
    if field == "k":
        lay.k = 0
    else:
        getattr(lay, field)[0] += 1
    stopped = []

    def seen(*a):
        y = REAL_TRY_DECODE(*a)
        stopped.append((y.layer, y.h is not None) if type(y) is decode_stack.Partial else None)
        return y

    monkeypatch.setattr(decode_stack, "try_decode", seen)
    assert torch.equal(_decode(model, ids, 14), want)
    assert stopped == [(layer, bool(half))] * 6
