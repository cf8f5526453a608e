"""The AVX2 + FMA prompt products (strata/kernels/prefill_avx2.h, a CPU without AMX) against exact math.

Each AVX2 decoder must equal gguf-py's decoder value for value; each product (float32 throughout)
must stay within 1e-5 of max |y| of float64 math on gguf-py's dequantized weights, at 1, 5, 17, 40
and 512 rows of x (a last group of 16 rows that is partial, one of at most 8), weight rows that are
not a multiple of the 6 / 12-row tiles or of the 48-row panels, rows of several 256-value k-chunks
and an odd number of blocks, 1 and 2 threads. A prompt's MoE layer in one C call against the
reference expert loop; the routing: which products take it, which keep the decode kernels.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from strata import kernels
from strata.formats.weights import QTensor
from strata.kernels import prompt
from test_prefill_kernels import gguf_dequantized, random_blocks, refused_allocations

pytestmark = pytest.mark.skipif(prompt.backend() != "avx2", reason="the prompt products here are not the AVX2 ones")

AVX2 = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ4_NL", "IQ4_XS"]


def _cols(name: str) -> int:
    """3 k-chunks of 256 for the 256-value blocks; 23 blocks of 32 (two chunks, the last partial) else"""
    return 3 * 256 if GGML_QUANT_SIZES[T[name]][0] == 256 else 23 * 32


@pytest.fixture
def q8x2():
    before = kernels.activations()
    kernels.set_activations("q8x2")
    yield
    kernels.set_activations(before)


def test_backend_and_types():
    assert prompt.available()
    for name in AVX2:
        assert prompt.has_type(T[name]) and prompt.has_type(T[name], own_only=True), name
        assert name in kernels.PROMPT_AVX2_MIN_ROWS
    for name in ("Q3_K", "Q2_K", "IQ3_S", "BF16"):  # no AVX2 decoder: today's path
        assert not prompt.has_type(T[name]), name


@pytest.mark.parametrize("name", AVX2)
def test_avx2_decoder_equals_reference(name):
    w = random_blocks(name, 4, _cols(name), seed=7)
    ref = gguf_dequantized(w)
    for r in range(w.shape[0]):
        got = prompt.dequant_row(w.raw[r], w.qtype, w.shape[1])
        assert got is not None and torch.equal(got, ref[r]), (name, r, float((got - ref[r]).abs().max()))


@pytest.mark.parametrize("name", AVX2)
@pytest.mark.parametrize("threads", [1, 2])
def test_avx2_product_matches_float64(name, threads):
    for wrows in (53, 101):  # 53: 4 tiles of 12 and a partial one; 101: two 48-row panels and a partial third
        w = random_blocks(name, wrows, _cols(name), seed=wrows)
        wd = gguf_dequantized(w).double()
        g = torch.Generator().manual_seed(wrows + threads)
        for tokens in (1, 5, 17, 40, 512):
            x = torch.randn(tokens, w.shape[1], generator=g)
            y = prompt.matmul(x, w, threads)
            assert y is not None and y.dtype == torch.float32 and y.shape == (tokens, wrows)
            ref = x.double() @ wd.T
            err = float((y.double() - ref).abs().max()) / float(ref.abs().max())
            assert err < 1e-5, (name, wrows, tokens, err)


def test_avx2_product_leading_shape_and_refusals():
    w = random_blocks("Q4_K", 30, 512)
    x = torch.randn(2, 9, 512)
    y = prompt.matmul(x, w, 1)
    assert y.shape == (2, 9, 30)
    ref = x.double() @ gguf_dequantized(w).double().T
    assert float((y.double() - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    assert prompt.matmul(torch.randn(4, 256), w) is None  # x's row length is not W's
    q3 = random_blocks("Q3_K", 30, 512)
    assert prompt.matmul(x, q3, 1) is None  # no AVX2 decoder


@pytest.mark.parametrize("first", [0, 1, 3])  # x's packing; the first panel's buffers
def test_avx2_product_out_of_memory_is_refused_and_falls_back(first, q8x2):
    w = random_blocks("Q6_K", 120, 512)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ gguf_dequantized(w).double().T
    with refused_allocations(first):
        assert prompt.matmul(x, w, 1) is None
    with kernels.prompt_batches(), refused_allocations(first):
        y = kernels.qmatmul(x, w, 1)
    assert float((y.double() - ref).abs().max()) < 2e-5 * float(ref.abs().max())


def _stacked(types, n_exp, hidden, ffn):
    parts = [random_blocks(t, n_exp * rows, cols, seed=i) for i, (t, rows, cols) in
             enumerate(zip(types, (ffn, ffn, hidden), (hidden, hidden, ffn)))]
    return tuple(QTensor(q.raw.reshape(n_exp, q.shape[0] // n_exp, -1), q.qtype, (n_exp, q.shape[0] // n_exp, q.shape[1]))
                 for q in parts)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XS", "IQ2_XS", "IQ2_XS"), ("Q8_0", "Q5_K", "Q4_0")])
@pytest.mark.parametrize("threads", [1, 2])
def test_avx2_moe_layer_matches_the_reference_expert_loop(types, threads, monkeypatch, q8x2):
    """A prompt's routed experts in one C call (prompt.moe, through grouped_swiglu) against the
    float64 expert loop on gguf-py's weights; expert 4 gets 3 rows (below PROMPT_AVX2_MIN_ROWS: its
    decode kernels), the others 17-60, one none."""
    from strata.kernels import grouped

    n_exp, hidden, ffn, tokens = 6, 512, 256, 90
    stacked = _stacked(types, n_exp, hidden, ffn)
    g = torch.Generator().manual_seed(11 + threads)
    x = torch.randn(tokens, hidden, generator=g) * 0.1
    ids = torch.stack([torch.randint(0, 3, (tokens,), generator=g), torch.full((tokens,), 3)], dim=1)
    ids[:3, 1] = 4  # expert 4: three rows; expert 5: none
    table = grouped.route_table(ids, torch.rand(tokens, 2, generator=g))
    calls = {"moe": 0}
    real = prompt.moe
    monkeypatch.setattr(prompt, "moe", lambda *a, **k: calls.__setitem__("moe", calls["moe"] + 1) or real(*a, **k))
    ref = grouped.grouped_swiglu(x.double(), table, tuple(QTensor(q.raw, q.qtype, q.shape) for q in stacked),
                                 lambda xs, a, b, c: grouped.swiglu_reference(xs, *(q.dequantize(torch.float64) for q in (a, b, c))))
    got = kernels.grouped_swiglu(x, table, stacked, threads)
    assert calls["moe"] == 1
    err = (got.double() - ref).abs().amax(dim=1) / ref.abs().amax(dim=1)
    assert float(err[3:].max()) < 2e-5  # float32 products only
    assert float(err[:3].max()) < 2e-3  # expert 4's rows in them: q8x2's 8-bit x
    # and one expert alone (prompt.swiglu), 17 rows
    one = grouped.as_source(stacked)(1)
    y = prompt.swiglu(x[:17], *one, threads)
    r = grouped.swiglu_reference(x[:17].double(), *(q.dequantize(torch.float64) for q in one))
    assert y is not None and float((y.double() - r).abs().max()) < 2e-5 * float(r.abs().max())


def test_avx2_routing(monkeypatch, q8x2):
    """Inside a prompt, a product of at least PROMPT_AVX2_MIN_ROWS rows takes the AVX2 product (exact
    float32: closer to float64 than the q8x2 decode kernel), one of fewer rows and a verify pass the
    decode kernels; a type without an AVX2 decoder keeps today's path."""
    calls = {"matmul": 0}
    real = prompt.matmul
    monkeypatch.setattr(prompt, "matmul", lambda *a, **k: calls.__setitem__("matmul", calls["matmul"] + 1) or real(*a, **k))
    w = random_blocks("Q4_K", 64, 512)
    n = kernels.PROMPT_AVX2_MIN_ROWS["Q4_K"]
    x = torch.randn(n, 512)
    ref = x.double() @ gguf_dequantized(w).double().T
    decode = kernels.qmatmul(x, w)  # not a prompt: the decode kernels
    assert calls["matmul"] == 0
    with kernels.prompt_batches():
        y = kernels.qmatmul(x, w)
        assert calls["matmul"] == 1
        kernels.qmatmul(x[: n - 1], w)  # fewer rows: the decode kernels
        assert calls["matmul"] == 1
        kernels.qmatmul(torch.randn(80, 512), random_blocks("Q3_K", 64, 512))  # no AVX2 decoder
        assert calls["matmul"] == 1
    err = float((y.double() - ref).abs().max())
    assert err < 1e-5 * float(ref.abs().max()) and err < float((decode.double() - ref).abs().max())


def test_avx2_moe_whole_experts_on_the_pool_equal_one_thread_bit_for_bit(q8x2):
    """At 2 threads a layer's many experts go to the pool whole (each on one thread) and their rows
    are summed in the route table's order: out equals the 1-thread result bit for bit."""
    from strata.kernels import grouped

    n_exp, hidden, ffn, tokens = 12, 512, 256, 150
    stacked = _stacked(("Q4_K", "IQ2_XS", "Q6_K"), n_exp, hidden, ffn)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=g) * 0.1
    ids = torch.stack([torch.randint(0, 5, (tokens,), generator=g), torch.randint(5, 10, (tokens,), generator=g)], dim=1)
    ids[:3, 1] = 11  # expert 11: three rows (its decode kernels); expert 10: none
    table = grouped.route_table(ids, torch.rand(tokens, 2, generator=g))
    used, counts = torch.unique_consecutive(table.expert, return_counts=True)
    spec = kernels._prompt_experts(x, stacked)
    outs = [prompt.moe(x, used, counts, table.token, table.weight, stacked, threads, *spec) for threads in (1, 2)]
    assert outs[0] is not None and outs[1] is not None
    assert outs[0].abs().max() > 0 and torch.equal(outs[0], outs[1])
