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
