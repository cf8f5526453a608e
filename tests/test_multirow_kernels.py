"""The multi-row q8x2 and q8c kernels (a verify pass's or a decode batch's rows against one weight row, each
block unpacked once): every row close to gguf-py's dequantized weights times x in float64, and
bit-equal to its one-row product, so a verify pass's positions are their one-token steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from strata import kernels
from strata.kernels import _build
from test_kernels import random_qtensor

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {_build.error()}")

# the types of the MoE releases and the bench files, then the rest of the one-pass kernels
RELEASE_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ2_XS")
OTHER_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ2_XXS", "IQ3_XXS", "IQ2_S", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "MXFP4")


@pytest.fixture
def q8x2():
    before = kernels.activations()
    kernels.set_activations("q8x2")
    yield _build.load()
    kernels.set_activations(before)


@pytest.fixture(params=["q8x2", "q8c"])
def one_pass(request):
    """(library, mode): "q8x2", and "q8c" (its own multi-row kernels for the 256-value types)."""
    before = kernels.activations()
    kernels.set_activations(request.param)
    yield _build.load(), request.param
    kernels.set_activations(before)


def _rows(n: int, cols: int, seed: int) -> torch.Tensor:
    """n rows of x, each its own scale (1e-3 to 10): a row computed from another row's activations
    is off by far more than the 8-bit error."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)]
    return torch.randn(n, cols, generator=g) * scale[:, None]


def _reference(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W^T in float64, W dequantized by gguf-py."""
    blocks = _build.raw_bytes(w).numpy().reshape(w.shape[0], -1)
    dense = torch.from_numpy(quants.dequantize(blocks, w.qtype).astype(np.float64))
    return x.double() @ dense.T


@needs_kernels
@pytest.mark.parametrize("qtype", RELEASE_TYPES + OTHER_TYPES)
@pytest.mark.parametrize("n", [2, 5, 17, 40])  # 40: more than the 32 rows one multi-row call takes
def test_multirow_product_rows_match_gguf_and_one_row_products(qtype, n, one_pass):
    lib, mode = one_pass
    if not lib.strata_fused_types(int(T[qtype])):
        pytest.skip(f"no one-pass {qtype} kernel on this CPU")
    # 256-value types: 3 blocks a row; 32-value types: 23 (groups of 4 blocks and a tail of 3)
    cols = 768 if quants.GGML_QUANT_SIZES[T[qtype]][0] == 256 else 736
    tol = 3e-2 if mode == "q8c" and cols == 768 else 1e-4  # q8c: one 8-bit pass (the 32-value types as q8x2)
    w = random_qtensor(qtype, (37, cols), seed=n)
    x = _rows(n, cols, seed=n)
    y = kernels.qmatmul_fast(x, w)
    ref = _reference(x, w)
    for i in range(n):
        err = (y[i].double() - ref[i]).abs().max().item()
        assert err <= tol * ref[i].abs().max().item(), (qtype, i, err)
        assert torch.equal(y[i:i + 1], kernels.qmatmul_fast(x[i:i + 1], w)), (qtype, i)
    lib.strata_set_multirow(0)
    try:
        assert torch.equal(y, kernels.qmatmul_fast(x, w))  # each row its one-row kernel: the same bits
    finally:
        lib.strata_set_multirow(1)


@needs_kernels
def test_release_types_have_multirow_kernels(q8x2):
    """Every 256-bit kernel set this CPU runs has a multi-row kernel for the release types' one-pass
    kernels but Q8_0's (its unpacking is one load: nothing to share)."""
    lib = q8x2
    isas = [bit for bit in _build.KERNEL_ISAS.values() if lib.strata_fused_isas() >> bit & 1 and bit < 3]
    if not isas:
        pytest.skip("no 256-bit kernel set on this CPU")
    try:
        for isa in isas:
            assert lib.strata_set_fused_isa(isa) == isa
            missing = [t for t in RELEASE_TYPES if t != "Q8_0" and lib.strata_fused_types(int(T[t])) and
                       not lib.strata_multirow_types(int(T[t]))]
            assert missing == [], (isa, missing)
    finally:
        lib.strata_set_fused_isa(-1)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "IQ2_XS", "Q4_0"])
def test_multirow_rows_through_a_pick(qtype, one_pass):
    """A few tokens' experts (strata_moe_tokens): each expert's rows are picked from the tokens' x,
    so the kernel reads rows out of order; each token's result is its one-token call's."""
    from strata.kernels import grouped

    n_exp, hidden, ffn, k, n = 4, 256, 512, 2, 6
    stacked = tuple(random_qtensor(qtype, shape, seed=s) for s, shape in
                    enumerate([(n_exp, ffn, hidden), (n_exp, ffn, hidden), (n_exp, hidden, ffn)]))
    x = _rows(n, hidden, seed=3)
    ids = torch.tensor([[0, 2], [3, 0], [2, 1], [0, 3], [1, 2], [2, 0]])
    w = torch.tensor([[0.7, 0.3]] * n)
    y = kernels.grouped_swiglu(x, grouped.route_table(ids, w), stacked)
    for i in range(n):
        one = kernels.grouped_swiglu(x[i:i + 1], grouped.route_table(ids[i:i + 1], w[i:i + 1]), stacked)
        assert torch.equal(y[i:i + 1], one), i
    ref = grouped.grouped_swiglu(x, grouped.route_table(ids, w), stacked)  # dequantized floats
    tol = 3e-2 if one_pass[1] == "q8c" and qtype != "Q4_0" else 1e-3
    for i in range(n):
        assert (y[i].double() - ref[i]).abs().max().item() <= tol * ref[i].abs().max().item(), i
