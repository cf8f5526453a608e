"""The one-call hyper-connection mix (kernels/f16.py try_hc_mix, hc_mix.c strata_hc_mix) against the
formula worked out here in float64 from the float16 weights, and against the module's torch form."""

import pytest
import torch

from strata import kernels
from strata.kernels import _build, f16
from strata.models.hyper_connections import HyperConnection
from strata.models.linear import Linear

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: {_build.error()}")


def _mixer(hidden, hc, rank, inject, seed):
    g = torch.Generator().manual_seed(seed)
    m = HyperConnection.__new__(HyperConnection)
    torch.nn.Module.__init__(m)
    m.hidden, m.hc, m.eps = hidden, hc, 1e-6
    width = hidden * hc
    m.norm = 1 + 0.3 * torch.randn(width, generator=g)
    m.down = Linear((torch.randn(rank, width, generator=g) / width ** 0.5).half())
    m.up = Linear((torch.randn(width, rank, generator=g) * 2 / rank ** 0.5).half())
    m.inject = Linear((torch.randn(hc, width, generator=g) / width ** 0.5).half()) if inject else None
    return m


def _reference(m, x):
    """HyperConnection's formula in float64 (its module docstring), from the stored float16 weights."""
    xd = x.double()
    streams = xd.unflatten(-1, (m.hc, m.hidden))
    xn = (streams * torch.rsqrt(streams.pow(2).mean(-1, keepdim=True) + m.eps)).flatten(-2) * m.norm.double()
    h = xn @ m.down.weight.double().T / m.hc
    gate = torch.sigmoid((h * torch.sigmoid(h)) @ m.up.weight.double().T)
    mixed = (gate * xn).unflatten(-1, (m.hc, m.hidden)).mean(-2)
    w = None if m.inject is None else 2 * torch.sigmoid(xn @ m.inject.weight.double().T / m.hc)
    return mixed, w


@needs_kernels
@pytest.mark.parametrize("hidden,hc,rank,inject", [(96, 4, 20, True), (40, 3, 7, False), (128, 4, 32, True)])
def test_hc_mix_one_call_matches_the_formula(hidden, hc, rank, inject):
    m = _mixer(hidden, hc, rank, inject, seed=hidden)
    x = 3 * torch.randn(5, 1, hidden * hc, generator=torch.Generator().manual_seed(1))
    x[2] *= 1e-3  # rows of their own sizes
    fast = f16.try_hc_mix(x, m.norm, m.down.weight, m.up.weight, None if m.inject is None else m.inject.weight,
                          m.hc, m.hidden, m.eps)
    assert fast is not None
    mixed, w = fast
    ref_mixed, ref_w = _reference(m, x)
    assert mixed.shape == (5, 1, hidden) and mixed.dtype == torch.float32
    assert (mixed.double() - ref_mixed).abs().max() <= 1e-5 * ref_mixed.abs().max()
    if inject:
        assert w.shape == (5, 1, hc) and (w.double() - ref_w).abs().max() <= 1e-5
    else:
        assert w is None
    for i in range(5):  # each row as alone: a verify pass's position i is that one-token step
        one = f16.try_hc_mix(x[i:i + 1], m.norm, m.down.weight, m.up.weight,
                             None if m.inject is None else m.inject.weight, m.hc, m.hidden, m.eps)
        assert torch.equal(one[0], mixed[i:i + 1])
    # the module takes the one call, and its torch form (a prompt's rows) computes the same mix
    assert torch.equal(m.mix(x)[0], mixed)
    big = torch.randn(kernels.FAST_BATCH_MAX + 1, hidden * hc)
    slow = m.mix(big)
    ref_big = _reference(m, big)
    # (torch's float16 products round x to float16: ~1e-4 of the largest value)
    assert (slow[0].double() - ref_big[0]).abs().max() <= 1e-3 * ref_big[0].abs().max()


@needs_kernels
def test_hc_mix_declines_what_it_does_not_cover():
    m = _mixer(32, 4, 8, True, seed=0)
    x = torch.randn(1, 128)
    args = (m.norm, m.down.weight, m.up.weight, m.inject.weight, 4, 32, 1e-6)
    assert f16.try_hc_mix(x.double(), *args) is None  # not float32
    assert f16.try_hc_mix(torch.randn(1, 96), *args) is None  # wrong width
    assert f16.try_hc_mix(x, m.norm.double(), *args[1:]) is None  # norm not float32
    assert f16.try_hc_mix(x, m.norm, m.down.weight.float(), *args[2:]) is None  # not float16
    assert f16.try_hc_mix(torch.randn(kernels.FAST_BATCH_MAX + 1, 128), *args) is None  # a prompt
