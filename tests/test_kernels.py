"""The compiled quantized-matmul kernels against the torch reference (dequantize, then matmul)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from strata import kernels, quant, synth
from strata.kernels import _build
from strata.models.layers import ResidentExperts, softmax_topk
from strata.formats.weights import QTensor
from strata.synth import random_blocks

REQUIRED = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ2_XS", "IQ2_XXS", "IQ3_XXS", "IQ4_XS", "MXFP4")
ALL = tuple(_build.KERNEL_TYPES)

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {_build.error()}")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def random_qtensor(qtype, shape, seed=0, wild_scales=False) -> QTensor:
    """Valid random blocks; wild_scales also randomises the f16 scale's sign and exponent."""
    qtype = T[qtype] if isinstance(qtype, str) else qtype
    q = quant.get(qtype)
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    if qtype == T.IQ1_M:
        return _random_iq1_m(shape, rng, wild_scales)
    blocks = random_blocks(qtype, n // q.block_size, rng)
    if wild_scales and qtype != T.MXFP4:  # the main f16 scale: any sign, 20 octaves
        offset = synth._F16_FIELDS[qtype][0][0]
        sign = rng.choice([-1.0, 1.0], size=blocks.shape[0]).astype(np.float32)
        mag = np.exp2(rng.uniform(-16, 4, size=blocks.shape[0])).astype(np.float32)
        blocks[:, offset:offset + 2] = (sign * mag).astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = torch.from_numpy(blocks.reshape(*shape[:-1], -1).copy())
    return QTensor(raw, qtype, tuple(shape))


def _random_iq1_m(shape, rng, wild_scales) -> QTensor:
    """IQ1_M blocks (synth has none: its f16 scale is split over the top nibbles of the four
    u16 scale words): random bits, then a finite scale of about 0.02 (or a wild one) put there."""
    n_blocks = int(np.prod(shape)) // 256
    blocks = rng.integers(0, 256, size=(n_blocks, 56), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, n_blocks) * 0.02).astype(np.float32)
    if wild_scales:
        d = d * rng.choice([-1.0, 1.0], n_blocks) * np.exp2(rng.uniform(-16, 4, n_blocks))
    h = d.astype(np.float16).view(np.uint16).astype(np.uint16)
    words = blocks[:, 48:56].copy().view(np.uint16)  # [n, 4]
    for k in range(4):
        words[:, k] = (words[:, k] & 0x0FFF) | (((h >> (4 * k)) & 0xF) << 12)
    blocks[:, 48:56] = words.view(np.uint8)
    raw = torch.from_numpy(blocks.reshape(*shape[:-1], -1).copy())
    return QTensor(raw, T.IQ1_M, tuple(shape))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_required_types_have_kernels():
    assert set(REQUIRED) <= set(ALL)
    if kernels.available():
        assert {t.name for t in kernels.kernel_types()} == set(ALL)


MODES = ["q8x2", "q8", "q8c", "int16", "float32"]


@pytest.fixture(params=MODES)
def act_mode(request):
    """Run with 8-bit activations through ggml's dot products (where that library is installed),
    with and without the residual pass, int16 activations and float32 activations (exact)."""
    if request.param.startswith("q8") and not kernels.ggml_types():
        pytest.skip("llama.cpp's CPU library (ggml-python or llama-cpp-python) is not installed")
    before = kernels.activations()
    kernels.set_activations(request.param)
    yield request.param
    kernels.set_activations(before)


def q8c_error_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """What "q8c" may cost: each x moves by at most half its chunk's step d m_j, which is within
    (a_j + a / 32) / 127 (a_j: the 32 values' largest |x|, a: the 256 values'); plus 1e-5 of |W| @ |x|
    for float rounding."""
    a32 = x.reshape(x.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    a256 = x.reshape(x.shape[0], -1, 256).abs().amax(-1, keepdim=True)
    step = a32.reshape(x.shape[0], -1, 8, 1) + a256.unsqueeze(-1) / 32
    e = (step / 254).expand(-1, -1, -1, 32).reshape(x.shape)
    return e @ dense.abs().T + 1e-5 * (x.abs() @ dense.abs().T)


def q8_error_bound(x: torch.Tensor, dense: torch.Tensor, block: int) -> torch.Tensor:
    """What 8-bit activations may cost: each x in a block of `block` values moves by at most half a
    step (max |x| / 254) plus the f16 rounding of the block scale (max |x| * 2^-11 * 127 / 127), so
    |y - y_exact| <= |W| @ e; plus 2e-3 of |W| @ |x| for the f16 sums (q8_1) and float rounding."""
    xb = x.reshape(x.shape[0], -1, block).abs().amax(-1, keepdim=True)
    e = (xb * (1 / 254 + 2.0**-10)).expand(-1, -1, block).reshape(x.shape)
    return e @ dense.abs().T + 2e-3 * (x.abs() @ dense.abs().T)


@needs_kernels
@pytest.mark.parametrize("qtype", ALL)
def test_kernel_matches_reference(qtype, act_mode):
    if act_mode.startswith("q8") and qtype not in kernels.ggml_types():
        pytest.skip(f"ggml has no {qtype} dot product")
    bs = quant.get(T[qtype]).block_size
    cols = 3 * 256 if bs == 256 else 7 * 32  # several blocks, not a power of two
    for rows, seed in ((37, 1), (5, 2)):  # odd row counts; fewer rows than a tile
        w = random_qtensor(qtype, (rows, cols), seed=seed, wild_scales=True)
        dense = w.dequantize()
        assert torch.isfinite(dense).all()
        for batch in (1, 3, 8, 11):
            x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch))
            ref = x @ dense.T
            for threads in (1, 2):
                got = kernels.qmatmul_fast(x, w, threads=threads)
                assert got.shape == (batch, rows)
                if act_mode == "q8":  # the bound of 8-bit x, and a few percent of the largest output
                    assert ((got - ref).abs() <= q8_error_bound(x, dense, bs)).all(), (qtype, rows, batch)
                    assert rel_err(got, ref) < 3e-2, (qtype, rows, batch, threads)
                    continue
                if act_mode == "q8c" and bs == 256:  # one pass, a step per 32 values: within its bound,
                    assert ((got - ref).abs() <= q8c_error_bound(x, dense)).all(), (qtype, rows, batch)
                    assert rel_err(got, ref) < 3e-2, (qtype, rows, batch, threads)  # and ~25-55 % under "q8"'s
                    continue
                if act_mode in ("q8x2", "q8c"):  # the residual pass: as close as int16 (Q4_1/Q5_1: q8_1's f16 sums)
                    assert rel_err(got, ref) < (2e-3 if qtype in ("Q4_1", "Q5_1") else 3e-4), (qtype, rows, batch)
                    continue
                assert rel_err(got, ref) < (3e-4 if act_mode == "int16" else 1e-5), (qtype, rows, batch, threads)
                torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))


@needs_kernels
@pytest.mark.parametrize("qtype", ["IQ1_S", "IQ2_S", "IQ3_S"])
def test_ggml_only_types(qtype, act_mode):
    """Types only ggml multiplies: a kernel in "q8" mode, the reference path otherwise."""
    w = random_qtensor(qtype, (21, 512), seed=3)
    dense = w.dequantize()
    x = torch.randn(3, 512)
    ref = x @ dense.T
    assert kernels.has_kernel(w.qtype) == act_mode.startswith("q8")
    got = kernels.qmatmul(x, w)
    if act_mode.startswith("q8"):
        assert ((got - ref).abs() <= q8_error_bound(x, dense, 256)).all() and rel_err(got, ref) < 3e-2
    else:
        assert rel_err(got, ref) < 1e-5


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ2_XS", "Q8_0", "IQ4_NL"])
def test_prompt_batches_take_batched_products(qtype, act_mode):
    """Prompt-sized batches in the q8 modes: the AMX product where prefill.c dequantizes the type
    (from PROMPT_AMX_MIN_ROWS rows), else W dequantized by ggml (bfloat16 in "q8": each weight within
    half a bf16 step; float32 in "q8x2": exactly), one matmul; other modes: the reference."""
    from strata.kernels import prompt

    w = random_qtensor(qtype, (40, 512), seed=5)
    dense = w.dequantize()
    amx = prompt.has_type(w.qtype, own_only=True)
    table = kernels.prompt_min_rows(torch.bfloat16 if act_mode == "q8" else torch.float32)
    n = kernels._prompt_min_rows(w.qtype) if amx else table[qtype]  # AMX: PROMPT_AMX_MIN_ROWS; AVX2: per type
    x = torch.randn(n, 512)
    ref = x @ dense.T
    with kernels.prompt_batches():
        _check_prompt_batches(qtype, act_mode, w, dense, amx, n, x, ref)
    if act_mode.startswith("q8"):  # not a prompt (a verify pass, a decode batch): the decode kernels
        assert kernels.try_qmatmul_batched(x, w) is None


def _check_prompt_batches(qtype, act_mode, w, dense, amx, n, x, ref):
    if not act_mode.startswith("q8"):
        assert kernels.try_qmatmul_batched(x, w) is None
        return
    assert kernels.try_qmatmul_batched(x[: n - 1], w) is None  # below the crossover: the 8-bit kernel
    got = kernels.qmatmul(x, w)
    if act_mode == "q8":
        wb = kernels.dequantize_ggml(w, torch.bfloat16)
        assert ((wb.float() - dense).abs() <= dense.abs() * 2.0**-8).all()
        bound = 2.0**-7 * (x.abs() @ dense.abs().T) + 1e-6  # x and W each rounded to bf16
        assert ((got - ref).abs() <= bound).all() and rel_err(got, ref) < 1e-2
    else:
        torch.testing.assert_close(kernels.dequantize_ggml(w, torch.float32), dense)
        assert rel_err(got, ref) < (2e-5 if amx else 1e-5)
    # an expert over a prompt-sized batch uses it too
    g, u, d = (random_qtensor(qtype, s, seed=i) for i, s in enumerate([(256, 512), (256, 512), (512, 256)]))
    xe = torch.randn(64, 512)
    ye, re = kernels.expert_forward(xe, g, u, d), kernels.expert_forward_reference(xe, g, u, d)
    assert rel_err(ye, re) < (2e-2 if act_mode == "q8" else 1e-4)


def test_bad_activation_mode():
    with pytest.raises(ValueError, match="not one of"):
        kernels.set_activations("int4")


@needs_kernels
def test_qmatmul_shapes_dtypes_and_fallback():
    w = random_qtensor("Q4_K", (48, 512))
    x = torch.randn(2, 3, 512)
    ref = kernels.qmatmul_reference(x, w)
    got = kernels.qmatmul(x, w)
    assert got.shape == (2, 3, 48) and got.dtype == x.dtype
    assert rel_err(got, ref) < 1e-4
    # bfloat16 activations: computed in float32, returned in bfloat16
    xb = x.to(torch.bfloat16)
    gb = kernels.qmatmul(xb, w)
    assert gb.dtype == torch.bfloat16 and rel_err(gb.float(), ref) < 2e-2
    # batches above FAST_BATCH_MAX take the reference path
    xl = torch.randn(kernels.FAST_BATCH_MAX + 1, 512)
    assert rel_err(kernels.qmatmul(xl, w), xl @ w.dequantize().T) < 1e-6
    # empty batch
    assert kernels.qmatmul_fast(torch.zeros(0, 512), w).shape == (0, 48)
    # types without a kernel (F16 here) go to the reference
    f = QTensor.from_float(torch.randn(16, 64).half())
    xf = torch.randn(1, 64)
    assert not kernels.has_kernel(f.qtype)
    assert rel_err(kernels.qmatmul(xf, f), xf @ f.dequantize().T) < 1e-6
    with pytest.raises(ValueError):
        kernels.qmatmul_fast(torch.randn(1, 256), w)


@needs_kernels
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XS", "IQ2_XS", "IQ2_XS"),
                                   ("IQ3_XXS", "IQ4_XS", "Q5_K"), ("MXFP4", "MXFP4", "Q8_0")])
def test_expert_forward_matches_reference(types):
    hidden, ffn = 512, 256
    g = random_qtensor(types[0], (ffn, hidden), seed=1)
    u = random_qtensor(types[1], (ffn, hidden), seed=2)
    d = random_qtensor(types[2], (hidden, ffn), seed=3)
    for n in (1, 3, 8):
        x = torch.randn(n, hidden)
        ref = kernels.expert_forward_reference(x, g, u, d)
        got = kernels.expert_forward(x, g, u, d)
        assert rel_err(got, ref) < 1e-3


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "IQ2_XS"])
def test_moe_layer_matches_reference(qtype, act_mode, monkeypatch):
    """A whole routed-expert layer (ResidentExperts) with and without the kernels.

    float32 activations: float rounding only. int16 activations (x, and the hidden h of each
    expert, quantized per row): measured up to 1.5e-4 of the output's max over 200 draws.
    8-bit activations (ggml's q8 blocks): a few 1e-3, as llama.cpp computes; with the residual
    pass ("q8x2") as close as int16.
    """
    E, k, hidden, ffn = 16, 4, 512, 256
    gate = random_qtensor(qtype, (E, ffn, hidden), seed=4)
    up = random_qtensor(qtype, (E, ffn, hidden), seed=5)
    down = random_qtensor("Q6_K" if qtype == "Q4_K" else qtype, (E, hidden, ffn), seed=6)
    experts = ResidentExperts(gate, up, down)
    g = torch.Generator().manual_seed(9)
    router = torch.randn(E, hidden, generator=g)
    tol = {"q8": 3e-2, "q8c": 2e-2, "q8x2": 1e-3, "int16": 1e-3, "float32": 1e-5}[act_mode]
    for n_tokens in (1, 7, 40):  # 40: some experts get several tokens, batched in the kernel
        x = torch.randn(n_tokens, hidden, generator=g)
        ids, weights = softmax_topk(x @ router.T, k, normalize=True)
        assert kernels.experts_fast_ok(x, gate, up, down)
        fast = experts(x, ids, weights)
        monkeypatch.setattr(kernels, "USE_KERNELS", False)
        ref = experts(x, ids, weights)
        monkeypatch.setattr(kernels, "USE_KERNELS", True)
        torch.testing.assert_close(fast, ref, rtol=tol, atol=tol * float(ref.abs().max()))


def test_unavailable_library_means_reference(monkeypatch):
    monkeypatch.setattr(_build, "_tried", True)
    monkeypatch.setattr(_build, "_lib", None)
    w = random_qtensor("Q4_K", (16, 256))
    x = torch.randn(1, 256)
    assert not kernels.available() and not kernels.has_kernel(w.qtype)
    assert rel_err(kernels.qmatmul(x, w), x @ w.dequantize().T) < 1e-6
    with pytest.raises(RuntimeError):
        kernels.qmatmul_fast(x, w)


@needs_kernels
def test_expert_forward_mixed_types():
    """A matrix without a kernel (F16 here) takes the reference inside an otherwise fast expert."""
    hidden, ffn = 256, 256
    g = random_qtensor("Q4_K", (ffn, hidden), seed=7)
    u = QTensor.from_float(torch.randn(ffn, hidden).half() * 0.02)
    d = random_qtensor("Q8_0", (hidden, ffn), seed=8)
    x = torch.randn(2, hidden)
    assert rel_err(kernels.expert_forward(x, g, u, d), kernels.expert_forward_reference(x, g, u, d)) < 1e-3


@needs_kernels
def test_non_finite_activations_propagate(act_mode):
    w = random_qtensor("Q4_K", (16, 256))
    x = torch.randn(2, 256)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    got, ref = kernels.qmatmul_fast(x, w), x @ w.dequantize().T
    assert torch.isnan(got[0]).all() and torch.isnan(ref[0]).all()
    assert (~torch.isfinite(got[1])).all()


@needs_kernels
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XS", "IQ2_XS", "Q2_K")])
def test_one_token_moe_in_one_call_equals_expert_by_expert(types, act_mode, monkeypatch):
    """strata_moe_token (one C call for a decode token's k experts) against the per-expert path."""
    E, hidden, ffn = 8, 512, 256
    gate, up = (random_qtensor(types[i], (E, ffn, hidden), seed=10 + i) for i in (0, 1))
    down = random_qtensor(types[2], (E, hidden, ffn), seed=12)
    x = torch.randn(1, hidden)
    ids, weights = torch.tensor([[5, 0, 3]]), torch.tensor([[0.5, 0.3, 0.2]])

    def expert(e):
        return gate[e], up[e], down[e]

    one_call = kernels.run_experts_fast(x, ids, weights, expert)
    monkeypatch.setattr(kernels, "_moe_token", lambda *a: False)
    by_expert = kernels.run_experts_fast(x, ids, weights, expert)
    assert rel_err(one_call, by_expert) < 1e-5


ONE_PASS_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_1", "Q8_0", "IQ2_XXS", "IQ2_XS", "IQ3_XXS",
                  "IQ4_XS", "MXFP4", "IQ4_NL", "Q4_0", "Q5_0", "IQ1_S", "IQ1_M", "IQ2_S", "IQ3_S"]


@contextlib.contextmanager
def kernel_isa(lib, isa: str):
    """Run the one-pass kernels of `isa` (_build.KERNEL_ISAS), skipping where the CPU lacks it."""
    if not lib.strata_fused_isas() >> _build.KERNEL_ISAS[isa] & 1:
        pytest.skip(f"this CPU does not run the {isa} kernels")
    assert lib.strata_set_fused_isa(_build.KERNEL_ISAS[isa]) == _build.KERNEL_ISAS[isa]
    try:
        yield
    finally:
        lib.strata_set_fused_isa(-1)


@needs_kernels
@pytest.mark.parametrize("isa", list(_build.KERNEL_ISAS))
def test_q8x2_keeps_its_accuracy_for_small_activations(isa):
    """"q8x2" stays ~3e-5 of max |y| from the exact product whatever x's scale. The q8_0 / q8_1
    blocks keep f16 scales: for a row under 2 in size the residual's scale fell below f16's normal
    range and the second pass added little (x ~ 1e-4: 8e-3, as far as one pass; x ~ 1e-2: 1e-4), as
    in a down projection of small SwiGLU outputs. K and IQ types (q8_K, float scales) never lost it."""
    lib = _build.load()
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        with kernel_isa(lib, isa):
            for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "Q4_K"):
                w = random_qtensor(qtype, (48, 256), seed=3)
                dense = w.dequantize(torch.float64)
                for scale in (1e-30, 1e-4, 1e-2, 1.0, 100.0):
                    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * scale
                    x[1] *= 1e-3  # rows of their own sizes
                    ref = x.double() @ dense.T
                    y = kernels.qmatmul_fast(x, w).double()
                    for r in range(3):
                        err = float((y[r] - ref[r]).abs().max() / ref[r].abs().max())
                        assert err < 1e-4, (qtype, scale, r, err)
    finally:
        kernels.set_activations(before)


@needs_kernels
def test_q8x2_through_ggmls_two_passes_keeps_its_accuracy_for_small_activations():
    """The same through ggml's two passes (the path of a CPU without the one-pass kernels, and of
    a type without one): its q8_0 / q8_1 blocks keep the f16 scales, so a row under 2 in size is
    quantized times a power of two and its products scaled back (x ~ 1e-4 was 1e-2 from exact).
    q8_1's own f16 block sums bound Q4_1 / Q5_1 at ~4e-4 whatever the scale (ggml's design)."""
    lib = _build.load()
    before = kernels.activations()
    kernels.set_activations("q8x2")
    lib.strata_set_fused(0)
    try:
        for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"):
            w = random_qtensor(qtype, (48, 256), seed=3)
            dense = w.dequantize(torch.float64)
            bound = 1e-3 if qtype in ("Q4_1", "Q5_1") else 1e-4
            for scale in (1e-30, 1e-4, 1e-2, 1.0, 100.0):
                x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)) * scale
                x[1] *= 1e-3  # rows of their own sizes
                ref = x.double() @ dense.T
                for threads in (1, 2):
                    y = kernels.qmatmul_fast(x, w, threads=threads).double()
                    for r in range(3):
                        err = float((y[r] - ref[r]).abs().max() / ref[r].abs().max())
                        assert err < bound, (qtype, scale, r, err)
    finally:
        lib.strata_set_fused(1)
        kernels.set_activations(before)


@needs_kernels
@pytest.mark.parametrize("isa", list(_build.KERNEL_ISAS))
@pytest.mark.parametrize("qtype", ONE_PASS_TYPES)
def test_fused_residual_pass_equals_ggmls_two_passes(qtype, isa):
    """"q8x2" in one pass (qmm.c's kernels: each weight block unpacked once for both 8-bit
    activations; AVX-512 VNNI, or the 256-bit AVX-VNNI and AVX2 sets that CPUs without it run)
    against ggml's vec_dot run twice: the same sums up to float order, and the 256-bit sets
    against the AVX-512 one where the CPU has both. The 256-bit sets' 32-value types take x in
    16-bit integers instead: each y within 5e-5 of its sum |x| |w| from the exact product. Q4_1 and Q5_1 take exact integer block sums
    of x where ggml's q8_1 keeps f16 ones, so there they must be closer to the exact product
    than the two passes."""
    lib = _build.load()
    if qtype not in kernels.ggml_types():
        pytest.skip(f"no ggml dot product for {qtype}")
    bs = quant.get(T[qtype]).block_size
    wide = lib.strata_fused_isas() >> _build.KERNEL_ISAS["avx512vnni"] & 1 and isa != "avx512vnni"
    # float order alone: measured <= 4e-7 of max |y|, Q6_K 2e-6 (the AVX-512 kernel takes 32 * sum(x)
    # off a sum of u6 * x); a tight bound, so that a wrong min or scale of one sub-block fails
    tol = 1e-5 if qtype == "Q6_K" else 2e-6
    # the 256-bit sets take the 32-value types against x in 16-bit integers (test_x16_kernels_...)
    x16 = bs == 32 and isa != "avx512vnni"
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        with kernel_isa(lib, isa):
            assert lib.strata_fused_types(int(T[qtype]))
            for rows, blocks, seed in ((37, 3, 1), (5, 1, 2), (300, 8, 3), (19, 7, 4)):
                cols = blocks * bs
                w = random_qtensor(qtype, (rows, cols), seed=seed, wild_scales=True)
                for batch in (1, 3):
                    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(batch)) * 3
                    ref = x @ w.dequantize().T
                    for threads in (1, 2):
                        lib.strata_set_fused(0)
                        two = kernels.qmatmul_fast(x, w, threads=threads)
                        lib.strata_set_fused(1)
                        one = kernels.qmatmul_fast(x, w, threads=threads)
                        if x16:  # another quantization of x than ggml's blocks, as close to the exact product
                            # (of each y's scale sum |x| |w|: 1.0-1.9e-5 at most over 40 seeds, as ggml's two passes)
                            err = ((one.double() - ref.double()).abs() / (x.abs() @ w.dequantize().abs().T).double()).max()
                            assert err < 5e-5, (qtype, rows, cols, batch, threads, float(err))
                            continue
                        if wide and threads == 1:
                            lib.strata_set_fused_isa(_build.KERNEL_ISAS["avx512vnni"])
                            assert rel_err(one, kernels.qmatmul_fast(x, w, threads=1)) < tol, (qtype, rows, cols)
                            lib.strata_set_fused_isa(_build.KERNEL_ISAS[isa])
                        if qtype in ("Q4_1", "Q5_1"):
                            assert rel_err(one, ref) < 1e-4 and rel_err(two, ref) < 2e-3, (rows, cols, batch)
                            continue
                        assert rel_err(one, two) < tol, (qtype, rows, cols, batch, threads)
                        # IQ3_XXS: ggml's two passes are 9.5e-4 from the exact product on the 5x256 case too
                        assert rel_err(one, ref) < (2e-3 if qtype == "IQ3_XXS" else 3e-4)
    finally:
        lib.strata_set_fused(1)
        kernels.set_activations(before)


@needs_kernels
@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4", "Q4_1", "Q5_1"])
def test_x16_kernels_are_exact_where_x_is_16_bit(qtype, isa):
    """The 256-bit sets' 32-value kernels take x as 16-bit integers times a float scale per 32
    values (max |x| / 32767). An x whose every block holds integers up to 32767, among them
    32767 itself, is that exactly, so the product must equal the exact one up to float32
    rounding (~1e-7 of max |y|): a wrong value, sign, fifth bit, scale or min of one block shows
    as 1e-3 or more. Wild block scales, and 1 and 3 rows, 1 and 2 threads."""
    lib = _build.load()
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        with kernel_isa(lib, isa):
            for rows, blocks, seed in ((37, 3, 1), (5, 1, 2), (300, 8, 3)):
                cols = blocks * 32
                w = random_qtensor(qtype, (rows, cols), seed=seed, wild_scales=True)
                for batch in (1, 3):
                    g = torch.Generator().manual_seed(seed + batch)
                    x = torch.randint(-32767, 32768, (batch, cols), generator=g).float()
                    x[:, ::32] = 32767.0
                    ref = x.double() @ w.dequantize().double().T
                    for threads in (1, 2):
                        y = kernels.qmatmul_fast(x, w, threads=threads).double()
                        assert rel_err(y, ref) < 1e-6, (qtype, rows, cols, batch, threads)
    finally:
        kernels.set_activations(before)


@needs_kernels
@pytest.mark.parametrize("isa", list(_build.KERNEL_ISAS))
@pytest.mark.parametrize("types", [("Q8_0", "Q4_1", "MXFP4"), ("Q5_0", "Q5_1", "IQ4_NL"), ("Q4_0", "IQ1_M", "Q4_K")])
def test_one_token_moe_in_one_call_with_each_kernel_set(types, isa, monkeypatch):
    """A decode token's experts in one call (strata_moe_token: its products share one parallel
    region, strata_qmm_many, with x laid out once per activation layout) against the products one
    by one (strata_qmm_ext), in "q8x2" with each one-pass kernel set: the 32-value types' kernels
    want x in their own layouts, which both paths must build alike."""
    lib = _build.load()
    if not all(t in kernels.ggml_types() for t in types):
        pytest.skip("ggml lacks one of the types")
    E, hidden, ffn = 4, 512, 256
    gate, up = (random_qtensor(types[i], (E, ffn, hidden), seed=20 + i) for i in (0, 1))
    down = random_qtensor(types[2], (E, hidden, ffn), seed=22)
    x = torch.randn(1, hidden)
    ids, weights = torch.tensor([[3, 0]]), torch.tensor([[0.6, 0.4]])

    def expert(e):
        return gate[e], up[e], down[e]

    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        with kernel_isa(lib, isa):
            one_call = kernels.run_experts_fast(x, ids, weights, expert)
            with monkeypatch.context() as m:
                m.setattr(kernels, "_moe_token", lambda *a: False)
                by_expert = kernels.run_experts_fast(x, ids, weights, expert)
        kernels.set_activations("float32")
        exact = kernels.run_experts_fast(x, ids, weights, expert)
    finally:
        kernels.set_activations(before)
    assert rel_err(one_call, by_expert) < 1e-5, (types, isa)
    assert rel_err(one_call, exact) < 1e-3, (types, isa)


@needs_kernels
def test_kernel_isa_env_forces_a_kernel_set(monkeypatch, caplog):
    """STRATA_KERNEL_ISA picks the one-pass set (load() applies it: checked once in a fresh
    process); a set the CPU cannot run, or a wrong name, leaves the best one with a warning."""
    lib = _build.load()
    runs = [n for n, bit in _build.KERNEL_ISAS.items() if lib.strata_fused_isas() >> bit & 1]
    if not runs:
        pytest.skip("no one-pass kernel set on this CPU")
    best = _build.KERNEL_ISAS[max(runs, key=_build.KERNEL_ISAS.get)]
    code = ("from strata.kernels import _build; lib = _build.load(); "
            "print('chosen', {b: n for n, b in _build.KERNEL_ISAS.items()}[lib.strata_fused_isa()])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "STRATA_KERNEL_ISA": runs[0]})
    assert r.returncode == 0 and f"chosen {runs[0]}" in r.stdout, (r.stdout, r.stderr)
    try:
        for value in ("avx9000", *(n for n in _build.KERNEL_ISAS if n not in runs)):
            lib.strata_set_fused_isa(-1)
            monkeypatch.setenv("STRATA_KERNEL_ISA", value)
            caplog.clear()
            _build._choose_isa(lib)
            assert lib.strata_fused_isa() == best and f"STRATA_KERNEL_ISA={value}" in caplog.text, value
        for value in runs:
            monkeypatch.setenv("STRATA_KERNEL_ISA", value.upper())
            _build._choose_isa(lib)
            assert lib.strata_fused_isa() == _build.KERNEL_ISAS[value]
    finally:
        lib.strata_set_fused_isa(-1)


def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        first = open("/proc/cpuinfo").read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


def _amd_avx512() -> bool:
    """AMD family 19h (Zen 4) or later with AVX-512 (qmm.c's split_avx512), from /proc/cpuinfo."""
    fields = _cpuinfo()
    return (fields.get("vendor_id") == "AuthenticAMD" and int(fields.get("cpu family", "0")) >= 25
            and "avx512_vnni" in fields.get("flags", "").split())


def _permute_kernels() -> bool:
    """The AVX-512 set has its byte-permute IQ2_XS, IQ2_XXS and IQ3_XXS kernels (-march=native: VBMI, BITALG)."""
    return {"avx512vbmi", "avx512_bitalg"} <= set(_cpuinfo().get("flags", "").split())


# qmm.c's prefer_256
PREFER_256 = {"Q4_0", "Q4_1", "IQ4_NL"} | (set() if _permute_kernels() else {"IQ2_XS", "IQ2_XXS", "IQ3_XXS"})


@needs_kernels
def test_mixed_kernel_set_takes_each_type_from_its_set():
    """On AMD's AVX-512 CPUs (Zen 4, Zen 5) the chosen set takes Q4_0, Q4_1, IQ4_NL (and IQ2_XS,
    IQ2_XXS, IQ3_XXS without AVX-512 VBMI) from the 256-bit kernels (faster there, and multi-row) and the rest from the
    AVX-512 ones: each product bit for bit the one of the set it should come from. Forced mixing runs
    on any CPU with both sets; the automatic choice is checked against /proc/cpuinfo."""
    lib = _build.load()
    isas = lib.strata_fused_isas()
    if not (isas >> 3 & 1 and isas & 6):
        pytest.skip("this CPU does not run both the AVX-512 VNNI and a 256-bit kernel set")
    narrow = 2 if isas >> 2 & 1 else 1
    before = kernels.activations()
    kernels.set_activations("q8x2")
    try:
        lib.strata_set_fused_isa(-1)
        assert lib.strata_fused_mixed() == int(_amd_avx512())
        for qtype in ONE_PASS_TYPES:
            if qtype not in kernels.ggml_types():
                continue
            w = random_qtensor(qtype, (64, 512), seed=21)
            x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
            by_set = {}
            for isa in (3, narrow):
                assert lib.strata_set_fused_isa(isa) == isa and not lib.strata_fused_mixed()
                by_set[isa] = (kernels.qmatmul_fast(x[:1], w), kernels.qmatmul_fast(x, w))
            lib.strata_set_fused_isa(3)
            assert lib.strata_set_fused_mixed(1)
            got = (kernels.qmatmul_fast(x[:1], w), kernels.qmatmul_fast(x, w))
            want = by_set[narrow if qtype in PREFER_256 else 3]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), qtype
            if qtype in PREFER_256:  # the sets differ on these, so the test tells them apart
                assert not torch.equal(by_set[3][1], by_set[narrow][1]), qtype
            assert not lib.strata_set_fused_mixed(0)
    finally:
        lib.strata_set_fused_isa(-1)
        kernels.set_activations(before)


def _gcc_on_x86() -> str:
    import platform

    cc = _build._compiler()
    if cc is None or platform.machine() not in ("x86_64", "AMD64") or "gcc" not in os.path.basename(cc):
        pytest.skip("needs gcc on x86-64")
    return cc


def test_kernels_build_for_cpus_without_avx():
    """The C kernels compile for a CPU without even AVX2 (-march=x86-64): the 256-bit sets are
    compiled under their own target pragmas (gcc refuses to inline an intrinsic the target lacks).
    -O0 and no output: a few seconds, not a full build."""
    cc = _gcc_on_x86()
    for source in _build.SOURCES:
        r = subprocess.run([cc, "-O0", "-march=x86-64", "-std=gnu11", "-c", "-o", os.devnull, str(source)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (source.name, r.stderr[-3000:])


HASWELL_RUN = """
import sys, torch
from strata.kernels import _build
_build.FLAGS[:] = ["-O0" if f.startswith("-O") else "-march=haswell" if f.startswith("-march") else f for f in _build.FLAGS]
lib = _build.load()
sys.path.insert(0, sys.argv[1])
from test_kernels import random_qtensor, rel_err  # loads the library too: after the flags above
from strata import kernels
assert lib is not None, _build.error()
print("isas", lib.strata_fused_isas(), "in use", lib.strata_fused_isa())
kernels.set_activations("q8x2")
for name in ("Q4_K", "IQ2_XS", "IQ1_M", "Q4_0"):
    w = random_qtensor(name, (37, 768), seed=1, wild_scales=True)
    x = torch.randn(3, 768) * 3
    lib.strata_set_fused(0)
    two = kernels.qmatmul_fast(x, w, threads=2)
    lib.strata_set_fused(1)
    one = kernels.qmatmul_fast(x, w, threads=2)
    print(name, lib.strata_fused_types(int(w.qtype)), rel_err(one, two), rel_err(one, x @ w.dequantize().T))
"""


@needs_kernels
def test_a_build_without_avx512_takes_the_256_bit_kernels(tmp_path):
    """The library built for a CPU without AVX-512 (-march=haswell, -O0 to keep it short, in a
    fresh process) runs here: it offers only the 256-bit sets, takes the best this CPU has, and
    its one pass agrees with ggml's two passes (Q4_0 within 1e-4: x in 16 bits there) and the exact
    product."""
    _gcc_on_x86()
    lib = _build.load()
    here = lib.strata_fused_isas() & 6  # AVX-VNNI and AVX2 bits: what a haswell build can offer here
    if not here or not kernels.ggml_types():
        pytest.skip("this CPU runs no 256-bit kernel set, or no ggml")
    r = subprocess.run([sys.executable, "-c", HASWELL_RUN, os.path.dirname(__file__)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "STRATA_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.split("\n")
    assert lines[0] == f"isas {here} in use {2 if here & 4 else 1}", r.stdout
    for line in lines[1:5]:
        name, has, vs_two, vs_exact = line.split()
        # Q4_0: x in 16-bit integers there, not ggml's 8-bit blocks, so not their float order
        assert has == "1" and float(vs_two) < (1e-4 if name == "Q4_0" else 2e-6) and float(vs_exact) < 3e-4, line


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "IQ2_XS"])  # an own kernel, a ggml-only type
def test_a_cached_plan_does_not_keep_the_weight_alive(qtype):
    """A disk-homed expert's bytes are read for one use and dropped: its cached kernel plan must
    not hold them (it did, and a run under --ram-memory grew by every expert it ever read)."""
    import gc
    import weakref

    if qtype not in kernels.ggml_types() and qtype not in _build.KERNEL_TYPES:
        pytest.skip(f"no kernel for {qtype}")
    w = random_qtensor(qtype, (64, 256), seed=3)
    x = torch.randn(2, 256)
    y = kernels.try_qmatmul(x, w)
    assert y is not None and rel_err(y, x @ w.dequantize().T) < 0.05
    gone, before = weakref.ref(w.raw), len(kernels._plans)
    del w
    gc.collect()
    assert gone() is None and len(kernels._plans) == before - 1
    strided = random_qtensor(qtype, (128, 256), seed=4)  # every other row: the plan keeps its copy
    v = QTensor(strided.raw[::2], strided.qtype, (64, 256))
    assert not v.raw.is_contiguous()
    assert rel_err(kernels.try_qmatmul(x, v), x @ v.dequantize().T) < 0.05


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ2_XS", "Q8_0"])
def test_quantized_linear_matches_dequantized(qtype, monkeypatch):
    """A Linear kept in blocks: decode rows by the kernel, prefill by dequantize + BLAS, and the
    reference path when the kernels are switched off; bias and F.linear on it too."""
    from strata.models.linear import Linear

    w = random_qtensor(qtype, (96, 512), seed=3)
    bias = torch.randn(96)
    lin = Linear(w, bias)
    dense = w.dequantize()
    for rows in (1, 5, kernels.FAST_BATCH_MAX + 1):
        x = torch.randn(1, rows, 512)
        ref = x @ dense.T + bias
        got = lin(x)
        assert got.shape == (1, rows, 96)
        if rows > kernels.FAST_BATCH_MAX:
            torch.testing.assert_close(got, F.linear(x, dense, bias))
        else:
            assert rel_err(got, ref) < 1e-3
        assert rel_err(F.linear(x, lin), ref) < 1e-3
    monkeypatch.setattr(kernels, "USE_KERNELS", False)
    x = torch.randn(2, 512)
    torch.testing.assert_close(lin(x), F.linear(x, dense, bias))


def test_linear_split_rows_and_embedding_rows():
    from strata.models.linear import Embedding, Linear

    w = random_qtensor("Q8_0", (12, 64), seed=4)
    dense = w.dequantize()
    a, b = Linear(w).split_rows(lambda rows: (rows[:4], rows[[10, 5, 6]]))
    assert a.quantized and a.shape == (4, 64) and b.shape == (3, 64)
    torch.testing.assert_close(a.dense(), dense[:4])
    torch.testing.assert_close(b.dense(), dense[[10, 5, 6]])
    table = Embedding(w)
    ids = torch.tensor([[3, 11, 3], [0, 7, 2]])
    assert torch.equal(table(ids), dense[ids])  # only these rows are decoded, exactly
    assert torch.equal(F.embedding(ids, table), dense[ids])
    assert torch.equal(Embedding(dense)(ids), dense[ids])


def test_loader_keeps_kernel_types_quantized_and_the_rest_float():
    """Dense weights stay in blocks only where a kernel multiplies them (4-8x less memory)."""
    from strata.models.weights import WeightLoader

    tensors = {"q4k": random_qtensor("Q4_K", (64, 256)), "iq2s": random_qtensor("IQ2_S", (64, 256)),
               "f32": QTensor.from_float(torch.randn(64, 256))}

    class Source:
        description = "test"

        def names(self):
            return list(tensors)

        def get(self, name):
            return tensors[name]

    w = WeightLoader(Source())
    q4k, iq2s, f32 = (w.linear(n, (64, 256)) for n in ("q4k", "iq2s", "f32"))
    assert q4k.quantized == kernels.has_kernel(T.Q4_K)
    if q4k.quantized:
        assert q4k.nbytes * 7 < 64 * 256 * 4  # 4.5 bits per weight against 32
    assert not iq2s.quantized and iq2s.weight.dtype == torch.float32  # no IQ2_S kernel: floats at load
    assert not f32.quantized
    torch.testing.assert_close(iq2s.dense(), tensors["iq2s"].dequantize())


# --- the accuracy bar on files quantized by llama.cpp itself ------------------------------------

def _ggml_quantizer(llama_cpp):
    """ggml's own quantizer (llama-cpp-python's libggml-base), with a flat importance matrix:
    llama_model_quantize refuses IQ2_XS without one."""
    import ctypes
    from pathlib import Path

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, p, p, i64, i64, i64, p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, i64]

    def quantize(array, qtype):
        a = np.ascontiguousarray(array, dtype=np.float32)
        n = a.shape[-1]
        out = np.empty((a.size // n, lib.ggml_row_size(int(qtype), n)), dtype=np.uint8)
        imatrix = np.ones(n, dtype=np.float32)
        lib.ggml_quantize_chunk(int(qtype), a.ctypes.data, out.ctypes.data, 0, a.size // n, n, imatrix.ctypes.data)
        return out.reshape(*a.shape[:-1], -1)

    return quantize


def write_llama_quantized(d, n_layers: int, context_length: int) -> dict:
    """A tiny MoE llama (K-quant-sized rows, randomised norms) in F32, and llama.cpp's Q8_0 and
    Q4_K_M of it (llama_model_quantize) and an IQ2_XS one (ggml's quantizer, flat imatrix):
    {name: path}. Skips where llama-cpp-python or its CPU library is missing."""
    llama_cpp = pytest.importorskip("llama_cpp")
    if "IQ2_XS" not in kernels.ggml_types():
        pytest.skip("llama.cpp's CPU library is not loaded by strata.kernels")
    import tiny
    from strata.formats import llama
    from strata.formats.hparams import RopeConfig
    from strata.gguf import writer

    shape = dict(hidden_size=256, ffn_size=256, n_heads=4, n_kv_heads=2, head_dim=64, n_layers=n_layers,
                 rope=RopeConfig(dim=64, interleaved=True), context_length=context_length)
    f32 = tiny.write_tiny_llama(d / "f32.gguf", **shape)
    files = {"F32": f32}
    for name, ftype in (("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 1
        out = d / f"{name}.gguf"
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) == 0
        files[name] = out
    c = tiny.llama_config(**shape)
    meta = {**llama.gguf_metadata(c), **tiny.byte_tokenizer_metadata()}
    tensors = [(n, t, T.F32 if t.dim() == 1 else T.Q8_0 if n == "token_embd.weight" else T.IQ2_XS)
               for n, t in tiny.llama_tensors(c).items()]
    mp = pytest.MonkeyPatch()
    mp.setattr(writer.quant, "quantize_reference", _ggml_quantizer(llama_cpp))
    try:
        files["IQ2_XS"] = writer.write_gguf(d / "IQ2_XS.gguf", "llama", meta, tensors)
    finally:
        mp.undo()
    return files


@pytest.fixture(scope="module")
def llama_quantized(tmp_path_factory):
    return write_llama_quantized(tmp_path_factory.mktemp("llama-quantized"), n_layers=2, context_length=64)


TOKENS = [5, 77, 140, 3, 200, 31, 9, 250, 64, 128, 7, 19, 222, 90, 45, 11]


def _strata_logits(path, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits, decode logits token by token) of TOKENS with the kernels in `mode`."""
    import strata

    before = kernels.activations()
    kernels.set_activations(mode)
    try:
        engine = strata.load(path, cpu_threads=1, draft="off")
        prefill = engine.logits(TOKENS).float()
        model = engine.model
        cache = model.new_cache(1)
        steps = []
        with torch.inference_mode():
            for t in TOKENS:
                steps.append(model(torch.tensor([[t]]), cache, last_only=True)[0, -1].float())
        engine.close()
    finally:
        kernels.set_activations(before)
    return prefill, torch.stack(steps)


def _llama_logits(llama_cpp, path) -> tuple[torch.Tensor, torch.Tensor]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(TOKENS)
    prefill = torch.tensor(np.array(llm.scores[: len(TOKENS)]))
    llm.reset()
    for t in TOKENS:
        llm.eval([t])
    decode = torch.tensor(np.array(llm.scores[: len(TOKENS)]))
    return prefill, decode


def test_q8_activations_within_llama_cpps_own_distance(llama_quantized):
    """The issue-13 bar: on files quantized by llama.cpp, Strata's default 8-bit activations
    ("q8x2": decode by two 8-bit passes, prefill by ggml-dequantized float32 products) stay closer
    to the exact dequantized math than llama.cpp itself; the single passes ("q8", llama.cpp's own
    arithmetic, and "q8c") stay within a quarter of llama.cpp's distance (measured: within 5 %; on
    the Q4_K_M file one token's expert choice flips under every single pass, llama.cpp's included,
    and that flip sets all three distances). First, on the F32 file both engines must compute the
    same model."""
    import llama_cpp

    exact_f32, _ = _strata_logits(llama_quantized["F32"], "float32")
    llama_f32, _ = _llama_logits(llama_cpp, llama_quantized["F32"])
    assert float((llama_f32 - exact_f32).abs().max()) < 1e-3 * float(exact_f32.abs().max()) + 1e-3

    def distance(pair, exact):
        return max(float((p - exact).abs().max()) for p in pair)

    for name in ("Q8_0", "Q4_K_M", "IQ2_XS"):
        path = llama_quantized[name]
        exact, exact_steps = _strata_logits(path, "float32")
        torch.testing.assert_close(exact_steps, exact, rtol=1e-4, atol=1e-4)  # decode = prefill
        theirs = distance(_llama_logits(llama_cpp, path), exact)
        ours = distance(_strata_logits(path, "q8x2"), exact)
        single = distance(_strata_logits(path, "q8"), exact)
        chunked = distance(_strata_logits(path, "q8c"), exact)
        print(f"{name}: max logit distance from exact dequantized math over {len(TOKENS)} tokens (prefill and "
              f"decode): strata q8x2 {ours:.4f}, strata q8c {chunked:.4f}, strata q8 {single:.4f}, "
              f"llama.cpp {theirs:.4f}")
        assert 0 < ours <= theirs, (name, ours, theirs)
        assert chunked <= 1.25 * theirs, (name, chunked, theirs)  # llama.cpp's class (a routing flip: not below)
        assert single <= 1.25 * theirs, (name, single, theirs)


@needs_kernels
@pytest.mark.parametrize("qtype", [t for t in ALL if quant.get(T[t]).block_size == 256])
def test_q8c_is_closer_to_exact_than_llama_cpps_single_pass(qtype):
    """"q8c" (a step per 32 values) against "q8" (ggml's q8_K, llama.cpp's own arithmetic) on x
    whose channels differ in scale, as a model's do: lower RMS error on every 256-value type
    (measured: 0.54-0.62x), and each product within q8c_error_bound."""
    if qtype not in kernels.ggml_types():
        pytest.skip(f"ggml has no {qtype} dot product")
    w = random_qtensor(qtype, (128, 2048), seed=11)
    dense = w.dequantize().double()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, 2048, generator=g) * torch.exp(0.7 * torch.randn(2048, generator=g))
    ref = x.double() @ dense.T
    before = kernels.activations()
    try:
        rms = {}
        for mode in ("q8", "q8c"):
            kernels.set_activations(mode)
            got = kernels.qmatmul_fast(x, w, threads=1).double()
            rms[mode] = float((got - ref).pow(2).mean().sqrt())
            if mode == "q8c":
                assert ((got - ref).abs() <= q8c_error_bound(x.double(), dense)).all()
    finally:
        kernels.set_activations(before)
    assert rms["q8c"] < 0.9 * rms["q8"], (qtype, rms)


@needs_kernels
def test_the_activations_option_sets_the_kernels_mode(tmp_path):
    """strata.load(activations=...) / --activations: the mode the kernels run in, the same tokens as
    exact math on a synth Q4_K file here, and a one-line error for a mode that is not one, or one
    that contradicts --exact-activations."""
    import strata
    from strata import synth
    from strata.errors import BadOption

    path = synth.write(tmp_path / "q4k.gguf", layers=1, quant_name="Q4_K_M", vocab=512)
    before = kernels.activations()
    try:
        exact = strata.load(path, cpu_threads=1, activations="float32").logits([1, 2, 3, 4])
        assert kernels.activations() == "float32"
        fast = strata.load(path, cpu_threads=1, activations="q8c")
        assert kernels.activations() == "q8c"
        got = fast.logits([1, 2, 3, 4])
        assert rel_err(got, exact) < 3e-2
        with pytest.raises(BadOption, match="disagree"):
            strata.load(path, exact_activations=True, activations="q8c")
        with pytest.raises(BadOption, match="not a mode"):
            strata.load(path, activations="int4")
    finally:
        kernels.set_activations(before)


@needs_kernels
def test_own_q8k_quantizer_writes_ggmls_bytes():
    """strata_q8k_quantize (x's q8_K blocks for "q8x2", vectorized) against ggml's own from_float
    for q8_K: rows with ties at 0.5, a repeated and a negated maximum, tiny and huge values, and an
    all-zero block (the reference leaves that block's sums unwritten: those bytes are not compared)."""
    import ctypes

    from strata.kernels import _ggml

    lib = _build.load()
    if not _ggml._libs:
        pytest.skip("ggml is not loaded")
    ref = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        _ggml._libs[1].ggml_get_type_traits_cpu(15).contents.from_float)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=g)
    x[1] = torch.arange(256) - 127.5  # halves: round to even
    x[2, 7] = x[2, 200] = 9.0  # the first of two equal maxima
    x[3, 3], x[3, 90] = -9.0, 9.0  # a negative maximum first
    x[4] *= 1e-30
    x[5] *= 1e30
    x[6] = 0.0
    x = x.reshape(-1).contiguous()
    n_blocks = x.numel() // 256
    ours = torch.zeros(n_blocks * 292, dtype=torch.uint8)
    theirs = torch.zeros(n_blocks * 292, dtype=torch.uint8)
    if not lib.strata_q8k_quantize(x.data_ptr(), ours.data_ptr(), x.numel()):
        pytest.skip("no AVX-512 or AVX2 in this build")
    ref(x.data_ptr(), theirs.data_ptr(), x.numel())
    ours, theirs = ours.view(n_blocks, 292), theirs.view(n_blocks, 292)
    assert torch.equal(ours[6, :260], theirs[6, :260]) and not ours[6, 260:].any()
    keep = [i for i in range(n_blocks) if i != 6]
    assert torch.equal(ours[keep], theirs[keep])


@needs_kernels
def test_iq2_xs_decode_product_matches_gguf_py():
    """The IQ2_XS decode kernel (the flagship's dense and expert gate/up weights) against gguf-py's
    own dequantization, not strata.quant's: every sign, grid entry and sub-block scale of random
    blocks, an odd row count, 1 and 2 threads, 1 and 3 rows of x."""
    import gguf.quants

    w = random_qtensor("IQ2_XS", (21, 5 * 256), seed=11, wild_scales=True)
    dense = torch.from_numpy(gguf.quants.dequantize(w.raw.numpy(), T.IQ2_XS)).double().reshape(21, 5 * 256)
    before = kernels.activations()
    for mode in ("q8x2", "int16"):  # the decode default (the suite runs int16) and the int16 kernels
        kernels.set_activations(mode)
        try:
            for batch in (1, 3):
                x = torch.randn(batch, 5 * 256, generator=torch.Generator().manual_seed(batch))
                ref = x.double() @ dense.T
                for threads in (1, 2):
                    got = kernels.qmatmul_fast(x, w, threads=threads).double()
                    assert rel_err(got, ref) < 3e-4, (mode, batch, threads, rel_err(got, ref))
        finally:
            kernels.set_activations(before)
