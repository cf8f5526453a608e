"""The Triton kernels against the torch reference (dequantize, then matmul; itself bit-exact
against gguf-py), and the tiers' device path through them.

Without CUDA the kernels run under Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 is
set for this module before `strata.kernels.gpu` first imports its kernels (the interpreter
replaces them at decoration), and restored after. With CUDA the same tests run compiled on
the device. Shapes are tiny because the interpreter runs each program in Python.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import strata
from strata import quant
from strata.kernels import gpu
from strata.kernels.grouped import grouped_swiglu, route_table, run_experts
from strata.formats.weights import QTensor
from strata.synth import random_blocks
from strata.tiers.executor import expert_source
from strata.tiers.store import expert_format

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

REQUIRED = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS", "IQ3_XXS")
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DEMO = Path(strata.__file__).parent / "demo" / "strata-demo.gguf"


@pytest.fixture(scope="module", autouse=True)
def triton_mode():
    """The interpreter where there is no GPU; the kernel module must not be compiled-mode already."""
    before = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
        from strata.kernels.gpu import kernels

        if not isinstance(kernels._qmv_kernel, __import__("triton").runtime.interpreter.InterpretedFunction):
            pytest.fail("strata.kernels.gpu.kernels was imported without TRITON_INTERPRET before this module")
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


def random_qtensor(qtype, shape, seed: int) -> QTensor:
    """Valid random blocks (synth's generator), scales of both signs for the f16-scaled types."""
    q = quant.get(qtype)
    rng = np.random.default_rng(seed)
    blocks = random_blocks(qtype, int(np.prod(shape)) // q.block_size, rng)
    if qtype in (T.Q8_0, T.Q6_K, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS):  # d at byte 0 or 208
        at = 208 if qtype == T.Q6_K else 0
        blocks[rng.random(len(blocks)) < 0.5, at + 1] ^= 0x80  # flip the sign bit of half the scales
    return QTensor(torch.from_numpy(blocks.reshape(*shape[:-1], -1).copy()).to(DEVICE), qtype, tuple(shape))


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def test_required_types_have_kernels():
    assert set(REQUIRED) <= {t.name for t in gpu.KERNEL_TYPES}
    assert not gpu.has_kernel(T.IQ1_S)


@pytest.mark.parametrize("qtype", [t.name for t in gpu.KERNEL_TYPES])
def test_qmatmul_matches_reference(qtype):
    from strata.kernels.gpu import kernels

    qt = T[qtype]
    cols = 2 * 256 if quant.get(qt).block_size == 256 else 7 * 32  # several blocks; a ragged last step
    for rows, batch, bn, seed in ((5, 1, 8, 1), (37, 1, 16, 2), (37, 3, None, 3)):  # odd rows, tile edges
        w = random_qtensor(qt, (rows, cols), seed)
        x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        ref = x @ w.dequantize().T
        got = kernels.qmatmul(x, w.raw, qt, w.shape, bn=None if CUDA else bn)  # one build per type on a GPU
        assert got.shape == (batch, rows)
        assert rel_err(got, ref) < 1e-3, (qtype, rows, batch)


@pytest.mark.parametrize("qtype", [t.name for t in gpu.KERNEL_TYPES])
def test_decoders_are_bit_exact(qtype):
    """Both kernels times rows of the identity: each output is one decoded weight times 1 plus zeros,
    so it must equal the reference dequantization bit for bit (the word loads, unpacking and
    spreading of shared fields included), for rows at every offset of the tile."""
    from strata.kernels import gpu as g
    from strata.kernels.gpu import kernels

    qt = T[qtype]
    cols = 256 if quant.get(qt).block_size == 256 else 7 * 32  # 32-value types: a ragged step
    w = random_qtensor(qt, (37, cols), seed=5)
    eye = torch.eye(cols, device=DEVICE)
    ref = w.dequantize().T
    assert kernels.word(qt, w.raw.data_ptr(), w.raw.shape[1]) == g.kernels.WORD[qt]  # aligned: the widest words
    assert torch.equal(kernels.qmatmul(eye[::17], w.raw, qt, w.shape), ref[::17])
    assert torch.equal(kernels.qmatmul_batched(eye, w.raw, qt, w.shape), ref)


def test_qmatmul_picks_triton_or_reference(monkeypatch):
    w = random_qtensor(T.Q4_K, (7, 256), 4)
    x = torch.randn(2, 3, 256, device=DEVICE)  # any leading shape
    ref = gpu.qmatmul_reference(x, w)
    assert gpu.applies(x, T.Q4_K)
    assert rel_err(gpu.qmatmul(x, w), ref) < 1e-3 and gpu.qmatmul(x, w).shape == (2, 3, 7)
    assert gpu.qmatmul(x.bfloat16(), w).dtype == torch.bfloat16
    big = torch.randn(gpu.MAX_ROWS + 1, 256, device=DEVICE)  # prefill-sized: the tiled kernel, no dequantize
    assert not gpu.applies(big, T.Q4_K) and gpu.on_triton(big, T.Q4_K)
    assert rel_err(gpu.qmatmul(big, w), gpu.qmatmul_reference(big, w)) < 1e-5
    assert not gpu.applies(x, T.IQ1_S)  # no decoder: the reference
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not gpu.applies(x, T.Q4_K)  # CPU tensors without the interpreter: the reference
    with pytest.raises(ValueError, match="cannot multiply"):
        gpu.qmatmul_triton(torch.randn(1, 128, device=DEVICE), w)


def stacked_experts(qtypes, n_experts: int, hidden: int, ffn: int, seed: int):
    """(gate, up, down) QTensors `[E, out, in]` of the given types."""
    shapes = ((n_experts, ffn, hidden), (n_experts, ffn, hidden), (n_experts, hidden, ffn))
    return tuple(random_qtensor(t, s, seed + i) for i, (t, s) in enumerate(zip(qtypes, shapes)))


def in_slots(stacked, fmt):
    """Experts copied into cache-like slots, one flat uint8 row each; parts(e) views slot e."""
    slots = torch.empty(stacked[0].shape[0], fmt.nbytes, dtype=torch.uint8, device=DEVICE)
    for e in range(slots.shape[0]):
        for view, q in zip(fmt.split(slots[e]), stacked):
            view.copy_(q.raw[e].reshape(-1))
    return lambda e: fmt.split(slots[e])


@pytest.mark.parametrize("qtypes, ffn, layout", [
    ((T.Q4_K, T.Q4_K, T.Q6_K), 256, "slots"),  # Q4_K_M's expert mix
    ((T.IQ2_XXS, T.IQ3_XXS, T.Q8_0), 96, "stacked"),
    ((T.MXFP4, T.MXFP4, T.MXFP4), 64, "slots"),
], ids=["q4_k-q6_k", "iq2_xxs-iq3_xxs-q8_0", "mxfp4"])
def test_grouped_product_matches_reference_moe(qtypes, ffn, layout):
    n_experts, hidden = 6, 256
    stacked = stacked_experts(qtypes, n_experts, hidden, ffn, seed=10)
    fmt = expert_format(stacked)
    parts = in_slots(stacked, fmt) if layout == "slots" else (lambda e: tuple(q.raw[e] for q in stacked))
    x = torch.randn(3, hidden, device=DEVICE)
    ids = torch.tensor([[0, 2], [2, 5], [1, 3]], device=DEVICE)  # expert 2 serves two tokens
    weights = torch.rand(3, 2, device=DEVICE)
    experts = {0, 2, 3, 5}  # expert 1 is elsewhere (a CPU miss): not in this product
    dense = [tuple(q.dequantize()[e] for q in stacked) for e in range(n_experts)]
    ref = run_experts(x, ids, weights, lambda e: dense[e], experts)
    got = gpu.grouped_swiglu(x, route_table(ids.cpu(), weights.cpu(), experts), expert_source(fmt, parts))
    assert rel_err(got, ref) < 1e-3
    assert got[2].abs().max() > 0  # token 2 still gets expert 3


@pytest.mark.parametrize("qtypes", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.F32, T.F32, T.F32)], ids=["q4_k-q6_k", "f32"])
def test_resident_experts_op_matches_reference(qtypes):
    """`strata::experts` (the device-resident MoE: pair metadata built on the device, no read back):
    Triton from the stacked blocks, or gathered float experts, equal the reference grouped product."""
    from strata.kernels.gpu import ops  # noqa: F401

    n_experts, hidden, ffn = 6, 256, 256
    if qtypes[0] == T.F32:
        g = torch.Generator().manual_seed(11)
        stacked = tuple(QTensor.from_float(torch.randn(s, generator=g).to(DEVICE) / 16)
                        for s in ((n_experts, ffn, hidden), (n_experts, ffn, hidden), (n_experts, hidden, ffn)))
    else:
        stacked = stacked_experts(qtypes, n_experts, hidden, ffn, seed=11)
    x = torch.randn(3, hidden, device=DEVICE)
    ids = torch.tensor([[0, 2], [2, 5], [1, 3]], device=DEVICE)
    weights = torch.rand(3, 2, device=DEVICE)
    dense = [tuple(q.dequantize()[e] for q in stacked) for e in range(n_experts)]
    ref = run_experts(x, ids, weights, lambda e: dense[e])
    g, u, d = stacked
    got = torch.ops.strata.experts(x, ids, weights, g.raw, u.raw, d.raw, [int(q) for q in qtypes], hidden, ffn)
    assert rel_err(got, ref) < 1e-3


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "IQ2_XS", "MXFP4"])
def test_prefill_product_from_blocks_never_dequantizes(qtype, monkeypatch):
    """A prefill-sized x W^T on the device (the `strata::qmatmul` op a device `Linear` calls) is the
    tiled Triton kernel over W's blocks: against the reference, in float32 and bfloat16 (whose
    output rounds to bf16: 2^-8), with no call to dequantize."""
    from strata.kernels.gpu import kernels, ops  # noqa: F401

    qt = T[qtype]
    cols = 512 if quant.get(qt).block_size == 256 else 9 * 32
    w = random_qtensor(qt, (70, cols), seed=13)
    x = torch.randn(gpu.MAX_ROWS + 36, cols, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    refs = {dt: (x.to(dt) @ w.dequantize(dt).T).float() for dt in (torch.float32, torch.bfloat16)}
    calls = []
    for name in ("dequantize",):
        real = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        got = torch.ops.strata.qmatmul(x.to(dt), w.raw, int(qt), cols)
        assert got.dtype == dt and rel_err(got, refs[dt]) < tol, (qtype, dt)
    if not CUDA:  # the interpreter runs exactly one of each tile: BM x BN programs
        assert kernels.batched_tile() == (64, 64)
    assert calls == [], "the prefill product dequantized the weight"


def test_qmatmul_op_matches_reference():
    from strata.kernels.gpu import ops  # noqa: F401

    w = random_qtensor(T.Q4_K, (64, 512), seed=12)
    x = torch.randn(2, 512, device=DEVICE)
    got = torch.ops.strata.qmatmul(x, w.raw, int(w.qtype), 512)
    assert rel_err(got, x @ w.dequantize().T) < 1e-3


def test_route_table_is_grouped_by_expert():
    ids = torch.tensor([[4, 1], [1, 7], [4, 0]])
    weights = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])
    table = route_table(ids, weights, {1, 4})
    assert table.expert.tolist() == [1, 1, 4, 4]
    assert table.token.tolist() == [0, 1, 0, 2] and table.weight.tolist() == pytest.approx([0.2, 0.3, 0.1, 0.5])


def test_tiers_device_path_runs_the_grouped_kernels(monkeypatch):
    """The whole model through the executor: hits computed by Triton from the cache's slots."""
    torch.manual_seed(0)
    calls = []
    product = gpu.grouped_swiglu

    def counting(x, *args):
        calls.append(x.shape[0])
        return product(x, *args)

    monkeypatch.setattr(gpu, "grouped_swiglu", counting)
    ids = [318, 288]
    from strata import kernels

    before = kernels.activations()
    kernels.set_activations("float32")  # the CPU reference exact, so 1e-4 measures the Triton half alone
    try:
        ref = strata.load(DEMO).logits(ids)
        engine = strata.load(DEMO, experts_cache="100%", cpu_threads=1)
        got = engine.logits(ids)
        engine.close()
    finally:
        kernels.set_activations(before)
    assert calls, "the device path did not use the Triton kernels"
    # the decoded values are bit-exact (test_decoders_are_bit_exact); what is left is the order of
    # float32 sums (the interpreter's pairwise tree against the CPU's), which this trained model
    # turns into 2.6e-4 at the logits (with numpy's order instead, they are equal)
    assert rel_err(got, ref) < 1e-3
    assert got[..., -1, :].argmax() == ref[..., -1, :].argmax()


@pytest.mark.skipif(CUDA, reason="compiled on the device by the other tests")
def test_kernels_compile_for_h200():
    """Compile to an sm_90 cubin with Triton's own ptxas: what the interpreter cannot check."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "strata.kernels.gpu.compile_check",
                           "--types", "IQ2_XS"], check=False, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("registers") == 4 and "local 0 B" in done.stdout and "stack 0 B" in done.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("qtype", REQUIRED)
def test_cuda_kernels_at_real_expert_size(qtype):
    """Qwen3-30B-A3B's expert shapes (768 x 2048 and back), compiled, against the reference."""
    from strata.kernels.gpu import kernels

    assert isinstance(kernels._qmv_kernel, __import__("triton").runtime.JITFunction)  # compiled, not interpreted
    qt = T[qtype]
    stacked = stacked_experts((qt, qt, qt), 16, 2048, 768, seed=20)
    for batch in (1, 8):
        x = torch.randn(batch, 2048, device=DEVICE)
        assert rel_err(kernels.qmatmul(x, stacked[0].raw[3], qt, (768, 2048)), x @ stacked[0].dequantize()[3].T) < 1e-3
    fmt = expert_format(stacked)
    parts = in_slots(stacked, fmt)
    ids = torch.randint(0, 16, (4, 8), device=DEVICE)
    weights = torch.rand(4, 8, device=DEVICE)
    experts = set(range(12))
    x = torch.randn(4, 2048, device=DEVICE)
    table = route_table(ids.cpu(), weights.cpu(), experts)
    got = gpu.grouped_swiglu(x, table, expert_source(fmt, parts))
    ref = grouped_swiglu(x, table.to(DEVICE), expert_source(fmt, parts))
    assert rel_err(got, ref) < 1e-3
