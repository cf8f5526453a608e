"""The C products a speculative verify pass takes for its few positions: float16 dense weights
(kernels/f16.py) and a few tokens' routed experts in one call (strata_moe_tokens). Each row must
come out exactly as a one-row call computes it (so a verify pass's first position is a decode
step's), and close to exact float arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata import kernels
from strata.kernels import _build, f16, grouped
from strata.models.linear import Linear
from test_kernels import random_qtensor

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {_build.error()}")


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(256, 128), (33, 77), (4096, 64), (7, 16), (40, 2080)])  # tails of every width; few long rows (small tiles)
def test_f16_product_is_exact_float_math_row_by_row(rows, cols):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, cols, generator=g).half()
    x = torch.randn(5, cols, generator=g)
    y = f16.try_f16_matmul(x, w)
    assert y is not None and y.dtype == torch.float32 and y.shape == (5, rows)
    exact = F.linear(x.double(), w.double())  # x itself, not rounded to float16
    assert (y - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    for i in range(5):  # each row as alone: a verify pass's position 0 is a decode step's
        assert torch.equal(f16.try_f16_matmul(x[i:i + 1], w), y[i:i + 1])
    # a Linear over a float16 weight takes it for decode-sized x, torch's product for a prompt
    assert torch.equal(Linear(w)(x), y)
    big = torch.randn(kernels.FAST_BATCH_MAX + 1, cols, generator=g)
    assert f16.try_f16_matmul(big, w) is None
    assert torch.allclose(Linear(w)(big), F.linear(big.half(), w).float())


@needs_kernels
def test_f16_product_declines_what_it_does_not_cover(monkeypatch):
    w = torch.randn(8, 32).half()
    assert f16.try_f16_matmul(torch.randn(2, 32), w.t().contiguous().t()) is None  # a strided weight
    assert f16.try_f16_matmul(torch.randn(2, 32), w.float()) is None  # not float16
    monkeypatch.setattr(kernels, "USE_KERNELS", False)
    assert f16.try_f16_matmul(torch.randn(2, 32), w) is None


@pytest.fixture
def q8x2():
    """The engine's default activations (ggml's products, each row of x on its own); the suite
    runs int16, whose own kernels block rows of x together."""
    before = kernels.activations()
    kernels.set_activations("q8x2")
    yield
    kernels.set_activations(before)


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_few_tokens_experts_equal_one_token_calls(qtype, q8x2):
    n_exp, hidden, ffn, k = 8, 256, 512, 3
    gate, up, down = (random_qtensor(qtype, shape, seed=s) for s, shape in
                      enumerate([(n_exp, ffn, hidden), (n_exp, ffn, hidden), (n_exp, hidden, ffn)]))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, hidden, generator=g) * 0.05
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(4)])
    ids[2] = ids[0]  # two tokens sharing every expert
    w = torch.rand(4, k, generator=g).sort(-1, descending=True).values  # a top-k router's order
    lib = _build.load()
    jobs = lib.strata_pool_jobs()
    y = kernels.grouped_swiglu(x, grouped.route_table(ids, w), (gate, up, down))
    assert lib.strata_pool_jobs() - jobs == 2  # all gates and ups over one quantized x, then all downs
    for i in range(4):  # one token at a time: strata_moe_token
        one = kernels.grouped_swiglu(x[i:i + 1], grouped.route_table(ids[i:i + 1], w[i:i + 1]), (gate, up, down))
        assert torch.equal(y[i:i + 1], one)
        alone = torch.zeros(1, hidden)  # strata_moe_token, the experts in the router's order
        assert kernels._moe_token(x[i:i + 1], [(gate[e], up[e], down[e]) for e in ids[i].tolist()],
                                  w[i].tolist(), None, alone)
        assert torch.equal(alone, one)
    ref = grouped.grouped_swiglu(x, grouped.route_table(ids, w), (gate, up, down))  # dequantized floats
    assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()  # 8-bit x; a wrong sum is O(1) off


def _count_prompt_products(monkeypatch) -> list[str]:
    """The names of prefill.c's products (and ggml's dequantize-then-matmul) as they are called."""
    from strata.kernels import prompt

    calls = []
    for mod, name in ((prompt, "matmul"), (prompt, "swiglu"), (prompt, "moe"), (kernels, "dequantize_ggml")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_K", "IQ2_XS", "Q8_0"])
def test_tier_verify_pass_rows_equal_one_token_steps(qtype, q8x2, monkeypatch):
    """A verify pass (or decode batch) over a tier's experts (a callable source: a RAM or disk home),
    8 positions routed to the same two experts, so each expert gets 8 rows, inside the prompt
    products' range (PROMPT_AMX_MIN_ROWS to FAST_BATCH_MAX): outside a prompt no prefill product
    runs, and each position comes out bit-equal to its one-token step, both as one call over the
    layer's experts and expert by expert (a disk home's arrival order, summed by the caller). A
    prompt's forward of the same rows does take the prefill product."""
    from strata.kernels import prompt

    n_exp, hidden, ffn, k, n = 4, 256, 512, 2, 8
    stacked = tuple(random_qtensor(qtype, shape, seed=s) for s, shape in
                    enumerate([(n_exp, ffn, hidden), (n_exp, ffn, hidden), (n_exp, hidden, ffn)]))
    parts = grouped.as_source(stacked)
    source = lambda e: parts(e)  # noqa: E731  (callable: a tier's home, not the stacked tensors)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, hidden, generator=g) * 0.05
    ids = torch.tensor([[3, 1]] * n)  # the router's order is not the experts' order
    w = torch.rand(n, k, generator=g).sort(-1, descending=True).values
    assert kernels.PROMPT_AMX_MIN_ROWS <= n <= kernels.FAST_BATCH_MAX
    calls = _count_prompt_products(monkeypatch)
    keep = {1, 3}  # the tiers' tables keep the experts a worker computes (sorted by expert, one token too)
    y = kernels.grouped_swiglu(x, grouped.route_table(ids, w, keep), source)
    each = {e: kernels.grouped_swiglu(x, grouped.route_table(ids, w, {e}), source) for e in (1, 3)}
    assert calls == []
    for i in range(n):
        one = kernels.grouped_swiglu(x[i:i + 1], grouped.route_table(ids[i:i + 1], w[i:i + 1], keep), source)
        assert torch.equal(y[i:i + 1], one), i
        alone = {e: kernels.grouped_swiglu(x[i:i + 1], grouped.route_table(ids[i:i + 1], w[i:i + 1], {e}), source)
                 for e in (1, 3)}
        for e in (1, 3):
            assert torch.equal(each[e][i:i + 1], alone[e]), (i, e)
    ref = grouped.grouped_swiglu(x, grouped.route_table(ids, w), stacked)
    assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    if prompt.has_type(stacked[0].qtype, own_only=True):
        with kernels.prompt_batches():
            kernels.grouped_swiglu(x, grouped.route_table(ids, w, keep), source)
        assert calls == ["swiglu", "swiglu"]


@needs_kernels
@pytest.mark.parametrize("home", ["ram", "disk"])
def test_tier_cpu_lane_keeps_a_verify_pass_on_the_decode_kernels(home, q8x2, tmp_path, monkeypatch):
    """The tiers' CPU lane computes on its own threads, where `in_prompt()` (per thread) would be
    False: a prompt's experts there still take prefill.c's product, a verify pass's (16 rows) do
    not, and its rows equal the one-token steps bit for bit. A disk home's verify pass computes its
    experts one call each, as their reads land (one read expert held at a time, as at decode)."""
    from strata.kernels import prompt
    from strata.tiers.executor import CpuLane
    from strata.tiers.store import DiskHome, FileReader, RamHome, expert_format

    n_exp, hidden, ffn, n = 4, 256, 512, 16
    stacked = tuple(random_qtensor("Q4_K", shape, seed=s) for s, shape in
                    enumerate([(n_exp, ffn, hidden), (n_exp, ffn, hidden), (n_exp, hidden, ffn)]))
    if home == "disk":
        path = tmp_path / "experts.bin"
        path.write_bytes(b"".join(q.raw.numpy().tobytes() for q in stacked))
        fmt = expert_format(stacked, [0, stacked[0].nbytes, stacked[0].nbytes + stacked[1].nbytes])
        where = DiskHome({0: fmt}, FileReader(path), capacity=1 << 20)
    else:
        fmt = expert_format(stacked)
        where = RamHome({0: fmt}, {0: n_exp}, sources={0: stacked})
    lane = CpuLane(2, {0: where}, {0: fmt})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, hidden, generator=g) * 0.05
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(n)])
    ids[: n // 2] = torch.tensor([0, 2])  # experts 0 and 2: at least 8 rows each
    w = torch.rand(n, 2, generator=g).sort(-1, descending=True).values
    used = sorted(set(ids.flatten().tolist()))
    calls = _count_prompt_products(monkeypatch)
    together = []
    moe_tokens = kernels._moe_tokens
    monkeypatch.setattr(kernels, "_moe_tokens", lambda x, table, experts, *a: together.append(
        len(torch.unique(table.expert))) or moe_tokens(x, table, experts, *a))
    amx = prompt.has_type(stacked[0].qtype, own_only=True)
    try:
        verify = sum(f.result() for f in lane.submit(0, x, ids, w, used))
        assert calls == [] and together
        if home == "disk":
            assert max(together) == 1
        steps = torch.cat([sum(f.result() for f in lane.submit(0, x[i:i + 1], ids[i:i + 1], w[i:i + 1], used))
                           for i in range(n)])
        with kernels.prompt_batches():
            prefill = sum(f.result() for f in lane.submit(0, x, ids, w, used))
        assert ("swiglu" in calls) == amx
    finally:
        lane.close()
    assert torch.equal(verify, steps)
    ref = grouped.grouped_swiglu(x, grouped.route_table(ids, w), stacked)
    for y in (verify, prefill):
        assert (y - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
