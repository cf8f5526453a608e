"""The tiers' router prefetch (strata/tiers/prefetch.py): how a prediction is computed."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from strata.tiers.prefetch import _predictor


def _block(hidden: int = 256, experts: int = 64, k: int = 4):
    g = torch.Generator().manual_seed(0)
    router = torch.randn(experts, hidden, generator=g)
    route = lambda logits: (logits.topk(k, dim=-1).indices, None)  # noqa: E731
    return SimpleNamespace(ffn_norm=lambda h: h * 2, ffn=SimpleNamespace(router=router, route=route))


def test_a_decode_prediction_runs_its_router_product_on_one_thread(monkeypatch):
    """On torch's OpenMP team the product left the team's other thread spinning after every layer."""
    block = _block()
    seen = []
    linear = F.linear

    def recording(x, w, b=None):
        seen.append(torch.get_num_threads())
        return linear(x, w, b)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(F, "linear", recording)
        h = torch.randn(1, 256)
        ids = _predictor(block)(h)
        assert seen == [1] and torch.get_num_threads() == 2
        assert torch.equal(ids, (2 * h @ block.ffn.router.T).topk(4, dim=-1).indices)
    finally:
        torch.set_num_threads(before)
