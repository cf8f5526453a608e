"""The decode step's small C operations (kernels/decode_ops.py) against the torch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata import kernels
from strata.formats.hparams import RopeConfig
from strata.kernels import decode_ops
from strata.kernels import _build
from strata.models.linear import Linear, linear_group
from strata.models.rope import Rope
from test_kernels import random_qtensor

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {_build.error()}")


@pytest.fixture
def activations():
    """Set the kernels' activation mode for one test (float32: the products see the same x up to
    rounding, so what differs is a half's own arithmetic; the 8-bit and int16 modes round x to
    their grid, and a rounding difference upstream can move a value to the next grid step)."""
    before = kernels.activations()
    yield kernels.set_activations
    kernels.set_activations(before)


@pytest.fixture
def torch_only(monkeypatch):
    """The torch path of the same modules: the C calls declined."""
    def off():
        monkeypatch.setattr(kernels, "USE_KERNELS", False)
    return off


@needs_kernels
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dim", [64, 32])  # whole head, partial rotation (the rest copied)
def test_rope_matches_torch(interleaved, dim, torch_only):
    rope = Rope(RopeConfig(dim=dim, interleaved=interleaved))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 64, generator=g)
    cs = rope.cos_sin(torch.tensor([[7, 8, 9], [100, 101, 102]]))
    fast = rope.apply(x, *cs)
    assert decode_ops.try_rope(x, *cs, dim, interleaved) is not None
    torch_only()
    assert torch.equal(fast, rope.apply(x, *cs))  # the same operations in the same order


@needs_kernels
@pytest.mark.parametrize("batch", [1, 3])
def test_projection_group_in_one_call_equals_one_by_one(batch, torch_only):
    """q/k/v with biases (and a type mix) in one strata_qmm_group call against each Linear alone."""
    g = torch.Generator().manual_seed(3)
    lins = (Linear(random_qtensor("Q4_K", (96, 512), seed=1), torch.randn(96, generator=g)),
            Linear(random_qtensor("Q6_K", (32, 512), seed=2)),
            Linear(random_qtensor("Q8_0", (32, 512), seed=3), torch.randn(32, generator=g)))
    x = torch.randn(batch, 1, 512, generator=g)
    assert decode_ops.try_qmatmul_group(x, tuple(lin.weight for lin in lins), tuple(lin.bias for lin in lins)) is not None
    grouped = linear_group(x, lins)
    alone = [lin(x) for lin in lins]
    for a, b in zip(grouped, alone):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch_only()
    for a, lin in zip(grouped, lins):  # and the reference: dequantize, then matmul
        ref = F.linear(x, lin.weight.dequantize(), lin.bias)
        assert float((a - ref).abs().max()) < 2e-2 * float(ref.abs().max())


def test_group_declines_what_it_cannot_take():
    w = random_qtensor("Q4_K", (16, 256), seed=4)
    assert decode_ops.try_qmatmul_group(torch.randn(100, 256), (w,), (None,)) is None  # a prompt
    assert decode_ops.try_qmatmul_group(torch.randn(1, 256, dtype=torch.bfloat16), (w,), (None,)) is None
    assert decode_ops.try_rope(torch.randn(1, 1, 2, 8), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 6, True) is None


def _counting(name: str):
    """decode_ops.<name> wrapped to count the calls the C half took (returned something)."""
    real = getattr(decode_ops, name)
    calls = [0]

    def counted(*a):
        y = real(*a)
        calls[0] += y is not None
        return y

    return calls, counted


def _decode_block(qk_norm: bool, bias: bool, seed: int = 0, gated: bool = False):
    """A llama-style block of quantized weights (hidden 256, 8 query heads of 32, 2 kv heads,
    partial rotary), built without a file; q/k norms, q/k/v biases and Qwen3-Next's output gate
    (`attn_q` rows per head: query, then gate) optional."""
    from torch import nn

    from strata.models.cache import KVCache  # noqa: F401
    from strata.models.layers import Attention, DenseFFN, RMSNorm
    from strata.models.transformer import Block

    g = torch.Generator().manual_seed(seed)
    hidden, hq, hkv, d, f = 256, 8, 2, 32, 512
    attn = Attention.__new__(Attention)
    nn.Module.__init__(attn)
    attn.n_heads, attn.n_kv, attn.head_dim, attn.gated = hq, hkv, d, gated
    b = (lambda n: torch.randn(n, generator=g)) if bias else (lambda n: None)
    q_rows = hq * d * (2 if gated else 1)
    attn.wq = Linear(random_qtensor("Q4_K", (q_rows, hidden), seed=seed + 1), b(q_rows))
    attn.wk = Linear(random_qtensor("Q6_K", (hkv * d, hidden), seed=seed + 2), b(hkv * d))
    attn.wv = Linear(random_qtensor("Q8_0", (hkv * d, hidden), seed=seed + 3), b(hkv * d))
    attn.wo = Linear(random_qtensor("Q4_K", (hidden, hq * d), seed=seed + 4))
    norm = (lambda n: RMSNorm(1 + 0.3 * torch.randn(n, generator=g), 1e-6))
    attn.q_norm, attn.k_norm = (norm(d), norm(d)) if qk_norm else (None, None)
    attn.rope = Rope(RopeConfig(dim=16, interleaved=not qk_norm))
    ffn = DenseFFN.__new__(DenseFFN)
    nn.Module.__init__(ffn)
    ffn.gate = Linear(random_qtensor("Q4_K", (f, hidden), seed=seed + 5))
    ffn.up = Linear(random_qtensor("Q5_K", (f, hidden), seed=seed + 6))
    ffn.down = Linear(random_qtensor("Q4_1", (hidden, f), seed=seed + 7))
    return Block(norm(hidden), attn, norm(hidden), ffn)


@needs_kernels
@pytest.mark.parametrize("qk_norm,bias,gated", [(False, False, False), (True, True, False), (True, False, True)])
def test_decode_layer_halves_in_one_call_each_match_torch(qk_norm, bias, gated, monkeypatch, activations):
    """A decode token's x + attn(norm(x)) and h + ffn(norm(h)) in one C call each
    (strata_attn_decode / strata_ffn_decode: norms, q/k/v, q/k norms, rope, the KV write, GQA
    attention over the cache, Qwen3-Next's sigmoid output gate, output projection, SwiGLU,
    residuals) against the torch modules, over a prompt and 6 decode positions (keys and values
    written where the torch path writes them)."""
    from strata.models.cache import KVCache, StepInfo
    from strata.models.layers import no_tap

    if gated:  # the gated output's int16 grid steps move it by 3e-5 of its scale (float32: 1.6e-6)
        activations("float32")
    block = _decode_block(qk_norm, bias, gated=gated)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randn(1, 5, 256, generator=g)
    caches = {}
    calls = {"attn": 0, "ffn": 0}
    attn_c, ffn_c = decode_ops.try_attention_block, decode_ops.try_ffn_block

    def count(name, fn):
        def wrapped(*a):
            y = fn(*a)
            calls[name] += y is not None
            return y
        return wrapped

    monkeypatch.setattr(decode_ops, "try_attention_block", count("attn", attn_c))
    monkeypatch.setattr(decode_ops, "try_ffn_block", count("ffn", ffn_c))
    outs = {}
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(decode_ops, "try_attention_block", lambda *a: None)
            monkeypatch.setattr(decode_ops, "try_ffn_block", lambda *a: None)
        cache = caches[fast] = KVCache()
        step = StepInfo(torch.tensor([0]), torch.tensor([5]), 5)
        block(prompt, cache, step, block.attn.rope.cos_sin(step.positions), no_tap)  # prefill: torch both times
        ys = []
        for pos in range(5, 11):
            x = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(pos))
            step = StepInfo(torch.tensor([pos]), torch.tensor([1]), 1)
            ys.append(block(x, cache, step, block.attn.rope.cos_sin(step.positions), no_tap) - x)  # what the block adds
        outs[fast] = torch.cat(ys, 1)
    assert calls == {"attn": 6, "ffn": 6}
    fast, ref = outs[True], outs[False]
    assert float((fast - ref).abs().max()) < 2e-5 * float(ref.abs().max())
    torch.testing.assert_close(caches[True].k[:, :, :11], caches[False].k[:, :, :11], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(caches[True].v[:, :, :11], caches[False].v[:, :, :11], rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K", "IQ2_XS"])
def test_decode_embedding_rows_by_ggml_equal_the_torch_decode(qtype, monkeypatch):
    """A decode step's embedding row of a quantized table comes from ggml's dequantizer (5 us; the
    torch decode of a Q4_K row took 120 us), equal to the torch decode."""
    from strata import quant
    from strata.models.linear import Embedding

    if qtype not in kernels.ggml_types():
        pytest.skip(f"no ggml dequantizer for {qtype}")
    w = random_qtensor(qtype, (40, 512), seed=5)
    emb = Embedding(w)
    ids = torch.tensor([[3, 17, 39]])
    ref = quant.dequantize(w.raw[ids.reshape(-1)], w.qtype, (3, 512)).reshape(1, 3, 512)

    def no_torch_decode(*a, **k):
        raise AssertionError("the torch decode on a decode step")

    monkeypatch.setattr(quant, "dequantize", no_torch_decode)
    assert torch.equal(emb(ids), ref)


@needs_kernels
@pytest.mark.parametrize("normalize,shared,mode", [(True, None, "int16"), (False, "gated", "int16"),
                                                   (True, "plain", "int16"), (False, "gated", "q8x2")])
def test_decode_moe_half_in_one_call_matches_torch(normalize, shared, mode, monkeypatch, activations):
    """A decode token's h + moe(norm(h)) in one C call (strata_moe_decode: norm, float32 router,
    softmax top-k, the resident stacked experts, a shared expert with or without its sigmoid gate;
    in the 8-bit modes the shared expert's products share the routed experts' parallel regions)
    against MoE's torch path, at 6 tokens."""
    activations(mode)
    from functools import partial

    from torch import nn

    from strata.models.cache import KVCache, StepInfo
    from strata.models.layers import Experts, ResidentExperts, SharedExpert, no_tap, softmax_topk
    from strata.models.transformer import MoE

    block = _decode_block(True, False, seed=3)
    g = torch.Generator().manual_seed(4)
    gate, up = (random_qtensor(t, (16, 256, 256), seed=20 + i) for i, t in enumerate(("Q4_K", "Q4_K")))
    down = random_qtensor("Q6_K", (16, 256, 256), seed=22)
    experts = Experts.__new__(Experts)
    nn.Module.__init__(experts)
    experts.layer, experts.n_experts, experts.backend = 0, 16, ResidentExperts(gate, up, down)
    shexp = None
    if shared:
        shexp = SharedExpert.__new__(SharedExpert)
        nn.Module.__init__(shexp)
        shexp.ffn = _decode_block(False, False, seed=9).ffn
        shexp.gate = torch.randn(1, 256, generator=g) / 16 if shared == "gated" else None
    block.ffn = MoE(torch.randn(16, 256, generator=g) / 16, experts, partial(softmax_topk, k=4, normalize=normalize),
                    shexp)
    calls, counted = _counting("try_moe_block")

    outs = {}
    for fast in (True, False):
        monkeypatch.setattr(decode_ops, "try_moe_block", counted if fast else (lambda *a: None))
        cache = KVCache()
        ys = []
        for pos in range(6):
            x = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(pos))
            step = StepInfo(torch.tensor([pos]), torch.tensor([1]), 1)
            ys.append(block(x, cache, step, block.attn.rope.cos_sin(step.positions), no_tap) - x)
        outs[fast] = torch.cat(ys, 1)
    assert calls[0] == 6
    fast, ref = outs[True], outs[False]
    assert float((fast - ref).abs().max()) < 2e-5 * float(ref.abs().max())


def _deltanet_block(gate_act: str = "silu", seed: int = 0):
    """A Gated DeltaNet block of quantized weights (hidden 256; 2 key heads of 32 shared by 4 value
    heads of 16, so d_k != d_v; conv kernel 4; a type mix in the in-projection group), built without
    a file, with random norms, conv taps, dt bias and decay rates from fast to slow."""
    from torch import nn

    from strata.models.gated_deltanet import GatedDeltaNet
    from strata.models.layers import RMSNorm
    from strata.models.transformer import Block

    g = torch.Generator().manual_seed(seed)
    hidden, nk, nv, dk, dv, kernel = 256, 2, 4, 32, 16, 4
    m = GatedDeltaNet.__new__(GatedDeltaNet)
    nn.Module.__init__(m)
    m.gate_act, m.nk, m.nv, m.dk, m.dv, m.kernel, m.eps, m.chunk = gate_act, nk, nv, dk, dv, kernel, 1e-6, 64
    m.key_dim, m.value_dim = nk * dk, nv * dv
    m.conv_dim = 2 * m.key_dim + m.value_dim
    m.wqkv = Linear(random_qtensor("Q4_K", (m.conv_dim, hidden), seed=seed + 11))
    m.wz = Linear(random_qtensor("Q6_K", (m.value_dim, hidden), seed=seed + 12))
    m.wb = Linear(random_qtensor("Q8_0", (nv, hidden), seed=seed + 13))
    m.wa = Linear(random_qtensor("Q4_K", (nv, hidden), seed=seed + 14))
    m.wo = Linear(random_qtensor("Q8_0", (hidden, m.value_dim), seed=seed + 15))
    m.conv_w = torch.randn(m.conv_dim, kernel, generator=g) / 2
    m.dt_bias = 0.5 * torch.randn(nv, generator=g)
    m.a = -torch.empty(nv).uniform_(0.02, 2.0, generator=g)
    m.norm = 1 + 0.3 * torch.randn(dv, generator=g)
    norm = (lambda n: RMSNorm(1 + 0.3 * torch.randn(n, generator=g), 1e-6))
    return Block(norm(hidden), m, norm(hidden), _decode_block(False, False, seed=seed + 20).ffn)


@needs_kernels
@pytest.mark.parametrize("gate_act,mode", [("silu", "float32"), ("silu", "int16"), ("sigmoid", "float32")])
def test_deltanet_decode_half_in_one_call_matches_torch(gate_act, mode, monkeypatch, activations):
    """A decode token's x + DeltaNet(norm(x)) in one C call (strata_gdn_decode: norm, the
    in-projection group, the causal conv step, q/k L2 norms over shared key heads, the gated delta
    rule step, the gated RMS norm, the out projection, the residual) against the torch module, over
    a prompt (torch, chunked) and 6 decode positions: outputs, the recurrent state and the conv window."""
    from strata.models.gated_deltanet import GDNCache
    from strata.models.cache import StepInfo
    from strata.models.layers import no_tap

    activations(mode)  # silu: Qwen3-Next's output gate; sigmoid: qwen4exp's
    block = _deltanet_block(gate_act)
    prompt = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(8))
    calls, counted = _counting("try_gdn_block")

    outs, caches = {}, {}
    for fast in (True, False):
        monkeypatch.setattr(decode_ops, "try_gdn_block", counted if fast else (lambda *a: None))
        cache = caches[fast] = GDNCache()
        step = StepInfo(torch.tensor([0]), torch.tensor([5]), 5)
        block(prompt, cache, step, None, no_tap)
        ys = []
        for pos in range(5, 11):
            x = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(pos))
            ys.append(block(x, cache, StepInfo(torch.tensor([pos]), torch.tensor([1]), 1), None, no_tap) - x)
        outs[fast] = torch.cat(ys, 1)
    assert calls[0] == 6
    fast, ref = outs[True], outs[False]
    assert float((fast - ref).abs().max()) < 2e-5 * float(ref.abs().max())
    torch.testing.assert_close(caches[True].state, caches[False].state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(caches[True].conv, caches[False].conv, rtol=1e-4, atol=1e-6)


@needs_kernels
def test_deltanet_decode_half_out_of_memory_leaves_the_state_and_falls_back(monkeypatch, activations):
    """strata_gdn_decode without memory for its buffer (prefill.c's test hook refuses it) returns
    None with the conv window and recurrent state untouched, and the block's torch form computes
    the token: equal to a run with memory (within the C half's rounding)."""
    import ctypes

    from strata.models.cache import StepInfo
    from strata.models.gated_deltanet import GDNCache
    from strata.models.layers import no_tap

    activations("float32")
    block = _deltanet_block("silu")
    refuse = _build.entry("strata_pp_test_fail_allocs", (ctypes.c_long, ctypes.c_long))
    prompt = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(8))
    x = torch.randn(1, 1, 256, generator=torch.Generator().manual_seed(9))
    outs = []
    for refused in (True, False):
        cache = GDNCache()
        block(prompt, cache, StepInfo(torch.tensor([0]), torch.tensor([5]), 5), None, no_tap)
        conv, state = cache.conv.clone(), cache.state.clone()
        step = StepInfo(torch.tensor([5]), torch.tensor([1]), 1)
        if refused:
            refuse(0, 1)
            try:
                assert decode_ops.try_gdn_block(x, block.attn_norm, block.attn, cache, step) is None
                assert torch.equal(cache.conv, conv) and torch.equal(cache.state, state)
                refuse(0, 10 ** 6)
                outs.append(block(x, cache, step, None, no_tap))
            finally:
                refuse(0, 0)
        else:
            outs.append(block(x, cache, step, None, no_tap))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=2e-5)


def _gdn_schedule(call, seed: int = 30):
    """Run `call(x, cache, step) -> output` over one GDNCache of 3 rows: a right-padded prompt (the
    torch form's chunks), two batch decode steps, two speculative verify passes (tracked, padded,
    rolled back by a different count per row, one all the way to the pass's start), a plain step.
    Returns each pass's output at its real positions and the cache's (conv, state) after each
    pass and each rollback."""
    from strata.models.cache import StepInfo
    from strata.models.gated_deltanet import GDNCache

    g = torch.Generator().manual_seed(seed)
    cache, lengths = GDNCache(), torch.zeros(3, dtype=torch.long)
    outs, states = [], []

    def run(t, n_new, drop=None):
        nonlocal lengths
        n_new = torch.tensor(n_new)
        x = torch.randn(3, t, 256, generator=g)
        y = call(x, cache, StepInfo(lengths.clone(), n_new, t))
        real = torch.arange(t)[None, :] < n_new[:, None]
        outs.append(y[real])
        lengths = lengths + n_new
        states.append((cache.conv.clone(), cache.state.clone()))  # padding left them as the row's last real token
        if drop is not None:
            cache.rollback(torch.tensor(drop))
            lengths = lengths - torch.tensor(drop)
            states.append((cache.conv.clone(), cache.state.clone()))

    run(5, [5, 3, 4])
    run(1, [1, 1, 1])
    run(1, [1, 1, 1])
    cache.track()
    run(3, [3, 2, 3], drop=[1, 0, 3])
    run(4, [4, 4, 1], drop=[0, 3, 1])
    cache.track(False)
    run(1, [1, 1, 1])
    return outs, states


def _assert_schedules_match(fast, ref, bound: float = 2e-5):
    """Every output, conv window and state within `bound` of the reference's largest value."""
    pairs = list(zip(fast[0], ref[0])) + [p for f, r in zip(fast[1], ref[1]) for p in zip(f, r)]
    for a, b in pairs:
        assert float((a - b).abs().max()) < bound * float(b.abs().max())


@needs_kernels
@pytest.mark.parametrize("mode", ["float32", "int16"])
def test_deltanet_decode_half_batch_and_verify_match_torch(mode, monkeypatch, activations):
    """Decode batches of 3 rows and speculative verify passes of 3-4 positions, right-padded, in
    one C call each (the state stepped row by row, position by position; a verify pass keeping
    the state after each position and the conv window), against the torch module: outputs at
    real positions, and the state and conv window after each pass and each rollback."""
    from strata.models.layers import no_tap

    activations(mode)
    block = _deltanet_block(seed=3)
    calls, counted = _counting("try_gdn_block")
    got = {}
    for fast in (True, False):
        monkeypatch.setattr(decode_ops, "try_gdn_block", counted if fast else (lambda *a: None))
        got[fast] = _gdn_schedule(lambda x, cache, step: block(x, cache, step, None, no_tap))
    assert calls[0] == 5  # all but the prompt
    # int16: x on its grid, where a norm's rounding can move a value one step (as above)
    _assert_schedules_match(got[True], got[False], 2e-5 if mode == "float32" else 1e-4)


@needs_kernels
def test_deltanet_mixer_in_one_call_with_permuted_out_projection(activations):
    """qwen4exp's form: the mixer without input norm or residual, its sigmoid gate, and ssm_out
    taking its input in the file's tiled order (an `InputPermutedLinear`), through
    `try_gdn_mixer`, against the torch module over the same batch and verify passes."""
    from strata.models.linear import InputPermutedLinear

    activations("float32")
    m = _deltanet_block("sigmoid", seed=4).attn
    m.wo = InputPermutedLinear(m.wo.weight, torch.randperm(m.value_dim, generator=torch.Generator().manual_seed(5)))
    n = [0]

    def fast(x, cache, step):
        y = decode_ops.try_gdn_mixer(x, m, cache, step)
        n[0] += y is not None
        return m(x, cache, step) if y is None else y

    got = _gdn_schedule(fast)
    assert n[0] == 5
    _assert_schedules_match(got, _gdn_schedule(lambda x, cache, step: m(x, cache, step)))


@needs_kernels
def test_deltanet_decode_half_declines_what_it_cannot_take(monkeypatch):
    """A prompt, a tracked pass whose per-position states pass STEP_BYTES (the torch form replays
    instead), more than FAST_BATCH_MAX tokens, bfloat16, an ssm_out order that is not a
    permutation and a float in-projection keep the torch path."""
    from strata.models.gated_deltanet import GDNCache
    from strata.models.cache import StepInfo

    block = _deltanet_block()
    norm, m = block.attn_norm, block.attn
    one = StepInfo(torch.tensor([0]), torch.tensor([1]), 1)
    three = StepInfo(torch.tensor([0]), torch.tensor([3]), 3)
    x = torch.randn(1, 1, 256)
    assert decode_ops.try_gdn_block(x, norm, m, GDNCache(), one) is not None
    tracked = GDNCache()
    tracked.track()
    assert decode_ops.try_gdn_block(torch.randn(1, 3, 256), norm, m, tracked, three) is not None
    monkeypatch.setattr(GDNCache, "STEP_BYTES", 2 * m.nv * m.dk * m.dv * 4)
    assert decode_ops.try_gdn_block(torch.randn(1, 3, 256), norm, m, tracked, three) is None
    assert decode_ops.try_gdn_block(torch.randn(1, 3, 256), norm, m, GDNCache(), three) is None
    wide = StepInfo(torch.zeros(65, dtype=torch.long), torch.ones(65, dtype=torch.long), 1)
    assert decode_ops.try_gdn_block(torch.randn(65, 1, 256), norm, m, GDNCache(), wide) is None
    assert decode_ops.try_gdn_block(x.bfloat16(), norm, m, GDNCache(), one) is None
    from strata.models.linear import InputPermutedLinear

    wo = m.wo
    m.wo = InputPermutedLinear(wo.weight, torch.zeros(m.value_dim, dtype=torch.long))  # not a permutation
    assert decode_ops.try_gdn_block(x, norm, m, GDNCache(), one) is None
    m.wo = wo
    m.wb = Linear(m.wb.dense())
    assert decode_ops.try_gdn_block(x, norm, m, GDNCache(), one) is None


@needs_kernels
@pytest.mark.parametrize("heads,kv,dim,threads", [(8, 2, 64, 1), (8, 2, 40, 4), (4, 1, 32, 3), (6, 6, 16, 2)])
def test_decode_attention_matches_float64(heads, kv, dim, threads):
    """The attention half's core (decode_attention.c: a kv head and its query heads, or a share of
    them, per pool tile; dot products in 16 lanes and a tail) against float64 softmax attention over
    300 cached positions of a larger cache: GQA, MQA split over 3 tiles (one empty), plain MHA."""
    import ctypes

    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = _build.entry("strata_attend_decode", (p, p, p, i64, i64, i64, i64, i64, p, p, ctypes.c_int))
    g = torch.Generator().manual_seed(heads * dim)
    cap, s = 320, 300
    q = torch.randn(heads, dim, generator=g)
    kc, vc = torch.randn(kv, cap, dim, generator=g), torch.randn(kv, cap, dim, generator=g)
    scores, att = torch.empty(heads * s), torch.full((heads, dim), float("nan"))
    fn(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), cap, s, heads, kv, dim, scores.data_ptr(), att.data_ptr(), threads)
    k, v = (t[:, :s].double().repeat_interleave(heads // kv, 0) for t in (kc, vc))
    probs = torch.softmax((k @ q.double()[:, :, None])[..., 0] / dim ** 0.5, -1)
    ref = (probs[:, None] @ v)[:, 0]
    torch.testing.assert_close(att.double(), ref, rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("heads,kv,dim,t", [(8, 2, 40, 3), (4, 4, 16, 1), (6, 1, 64, 4)])
def test_attention_of_several_new_tokens_matches_float64_and_one_token_steps(heads, kv, dim, t):
    """A verify pass's or decode batch's attention (decode_attention.c's strata_attend_rows, through
    KVCache.attend): rows of different lengths, t new tokens each, token j of row b seeing keys up to
    start[b] + j, against float64 softmax attention under StepInfo's causal mask; each (row, token)
    equal bit for bit to the one-token C attention over the same keys."""
    import ctypes

    from strata.models.cache import KVCache, StepInfo

    g = torch.Generator().manual_seed(heads + t)
    b, start = 3, torch.tensor([5, 17, 0])
    cache = KVCache()
    first = StepInfo(torch.zeros(b, dtype=torch.long), start, int(start.max()))
    w = int(start.max())
    cache.update_and_fetch(torch.randn(b, kv, w, dim, generator=g), torch.randn(b, kv, w, dim, generator=g), first)
    step = StepInfo(start, torch.full((b,), t), t)
    q = torch.randn(b, t, heads, dim, generator=g).transpose(1, 2)  # (B, H, T, D), strided as the layer's
    k, v = torch.randn(b, kv, t, dim, generator=g), torch.randn(b, kv, t, dim, generator=g)
    calls = []
    real = decode_ops.try_attend_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_ops, "try_attend_rows", lambda *a: calls.append(1) or real(*a))
        got = cache.attend(q, k, v, step)
    assert calls == [1] and got.shape == (b, heads, t, dim)
    keys, values = cache.k[:, :, :int(start.max()) + t].double(), cache.v[:, :, :int(start.max()) + t].double()
    keys, values = (u.repeat_interleave(heads // kv, 1) for u in (keys, values))
    scores = (q.double() @ keys.transpose(-1, -2)) / dim ** 0.5
    scores = scores.masked_fill(~step.attention_mask(keys.shape[2]), float("-inf"))
    want = torch.softmax(scores, -1) @ values
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    one = _build.entry("strata_attend_decode", (p, p, p, i64, i64, i64, i64, i64, p, p, ctypes.c_int))
    for row in range(b):
        for j in range(t):
            s = int(start[row]) + j + 1
            qj = q[row, :, j].contiguous()
            kc, vc = cache.k[row].contiguous(), cache.v[row].contiguous()
            scores1, att = torch.empty(heads * s), torch.empty(heads, dim)
            one(qj.data_ptr(), kc.data_ptr(), vc.data_ptr(), kc.shape[1], s, heads, kv, dim, scores1.data_ptr(),
                att.data_ptr(), 2)
            assert torch.equal(att, got[row, :, j]), (row, j)
    long = decode_ops.ROWS_NEW_MAX + 1  # a prompt's chunk, not a verify pass: torch's SDPA attends it
    assert decode_ops.try_attend_rows(torch.randn(1, heads, long, dim), cache.k[:1], cache.v[:1], start[:1]) is None
