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


class _Home:
    def __init__(self):
        self.asked = []

    def request(self, layer, experts, ahead=False):
        self.asked.append((layer, list(experts), ahead))


def test_a_second_prediction_reads_ahead_only_what_the_first_did_not_name():
    from strata.tiers.prefetch import Prefetcher
    from strata.tiers.stats import TierStats

    home = _Home()
    answers = iter([torch.tensor([[1, 2, 3]]), torch.tensor([[3, 4, 1]]), torch.tensor([[2, 4]])])
    p = Prefetcher({1: lambda h: next(answers)}, None, TierStats(), 8, {1: 100}, set(), disk_homes={1: home})
    mask = torch.ones(1, 1, dtype=torch.bool)
    x = torch.zeros(1, 1, 4)
    p(0, x, mask)
    p.refine(0, x, mask)
    p.refine(0, x, mask)  # nothing new: no request
    assert home.asked == [(1, [1, 2, 3], True), (1, [4], True)]
    assert p.stats.prediction[1] == {8 + e for e in (1, 2, 3, 4)} and p.stats.layer(1).predicted == 4
    p.refine(1, x, mask)  # no predictor for layer 2: nothing
    assert len(home.asked) == 2
