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


def test_a_cpu_prediction_runs_on_a_worker_and_is_settled_before_its_layer_routes():
    """Without a device cache the prediction (norm, router, top-k, reads ahead) runs on a worker while
    the calling thread goes on; `settle` waits for it, and a device cache keeps it on the caller."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from strata.tiers.prefetch import Prefetcher
    from strata.tiers.stats import TierStats

    release, where, asked = threading.Event(), [], []

    def predict(h):
        where.append(threading.current_thread().name)
        release.wait(5)
        return torch.tensor([[3, 1]])

    home = SimpleNamespace(readers=8, request=lambda layer, experts, ahead=False: asked.append((layer, experts, ahead)))
    x, mask = torch.randn(1, 1, 8), torch.ones(1, 1, dtype=torch.bool)
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as pool:
        pre = Prefetcher({1: predict}, None, TierStats(), 4, {1: 100}, {1}, disk_homes={1: home}, submit=pool.submit)
        pre(0, x, mask)  # returns while the prediction is still running
        assert asked == [] and pre.pending is not None
        release.set()
        pre.settle()
        assert asked == [(1, [1, 3], True)] and where[0].startswith("worker") and pre.pending is None
        on_device = Prefetcher({1: predict}, object(), TierStats(), 4, {1: 100}, set(), submit=pool.submit)
        assert on_device.submit is None  # a device cache's bookkeeping stays on the calling thread


def test_a_prompt_reads_ahead_only_what_most_of_its_tokens_predict():
    """A decode step reads ahead every predicted expert; a prompt, whose layer's own reads keep the disk
    busy, only the 2 x readers experts most of its rows predicted."""
    from strata.tiers.prefetch import _read_ahead

    ids = torch.tensor([[5, 1], [5, 2], [5, 3], [2, 4], [2, 6], [7, 8]])  # 5 thrice, 2 twice, the rest once
    experts = torch.unique(ids).tolist()
    assert _read_ahead(ids, experts, prefill=False, readers=1) == experts
    assert _read_ahead(ids, experts, prefill=True, readers=1) == [2, 5]
    assert _read_ahead(ids, experts, prefill=True, readers=8) == experts  # no more predicted than that
