"""The C causal depthwise conv of the Gated DeltaNet prefill (kernels.causal_conv) against a float64 conv1d."""

import pytest
import torch
import torch.nn.functional as F

from strata import kernels
from strata.kernels import _build
from strata.kernels.causal_conv import try_causal_conv

pytestmark = pytest.mark.skipif(_build.load() is None, reason="no C kernels on this machine")


def _reference(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch's depthwise conv1d (transformers' form) in float64, no padding: (B, K-1+T, C) -> (B, T, C)."""
    w = weight.double()[:, None, :]
    return F.conv1d(window.double().transpose(1, 2), w, groups=weight.shape[0]).transpose(1, 2)


@pytest.mark.parametrize("b, t, c, k, threads", [(2, 1, 40, 4, 1), (1, 37, 72, 4, 2), (3, 5, 19, 3, 2)])
def test_conv_matches_float64_conv1d(b, t, c, k, threads):
    g = torch.Generator().manual_seed(t)
    window, weight = torch.randn(b, k - 1 + t, c, generator=g), torch.randn(c, k, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = try_causal_conv(window, weight)
    finally:
        torch.set_num_threads(before)
    assert got is not None and got.shape == (b, t, c)
    assert (got.double() - _reference(window, weight)).abs().max().item() < 1e-5


def test_conv_runs_in_the_deltanet_layer_and_declines_what_it_does_not_take(monkeypatch):
    import strata.models.gated_deltanet as gd

    g = torch.Generator().manual_seed(0)
    layer = type("Conv", (), {"kernel": 4, "conv_w": torch.randn(24, 4, generator=g)})()
    x, state = torch.randn(2, 9, 24, generator=g), torch.randn(2, 3, 24, generator=g)
    taken = []
    monkeypatch.setattr(gd, "try_causal_conv", lambda *a: taken.append(try_causal_conv(*a)) or taken[-1])
    outs, states = [], []
    for on in (True, False):
        monkeypatch.setattr(kernels, "USE_KERNELS", on)
        cache = gd.GDNCache()
        cache.conv = state.clone()
        outs.append(gd.GatedDeltaNet._conv(layer, x, cache, torch.tensor([9, 6])))
        states.append(cache.conv)
    assert taken[0] is not None and taken[1] is None  # the C form, then torch's
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.equal(states[0], states[1])
    assert try_causal_conv(x.double(), layer.conv_w.double()) is None  # float64: torch's form
