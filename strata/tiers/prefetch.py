"""Prefetch: while layer L runs, layer L+1's router applied to L's input names its experts.

The residual stream changes little from one layer to the next, so the next router's
choice on the current hidden state is a good guess; predicted misses are copied in on
the copy stream (a thread without CUDA) while the model computes.

On the CPU the prediction is issued at once, before layer L's attention: on a worker (`submit`, the
CPU lane's pool, idle then) when there is no device cache, so the calling thread goes on with the
attention (the prediction's norm and router product were 45 ms a token of the full-size qwen4exp's
serial path), and `settle()` (layer L's routing, or the next block) waits for it, so the prediction is
counted and traced before the layer it precedes. On a device the ids stay
there and ride on layer L's own routing read (`take`, then `issue` from the executor, after L's
expert kernels are queued): no read of their own, and the copies, on the side stream behind an event
for L's kernels, overlap layer L+1's attention. A prediction whose block makes no routing read (a
dense block before an MoE one) is dropped on a device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from strata.kernels.threads import one_thread_if_small
from strata.tiers.executor import to_device
from strata.tiers.stats import TierStats

SOURCE = "Strata's prefetcher (layer L+1's router on layer L's input)"


class Prefetcher:
    def __init__(self, predictors: dict[int, Callable], cache, stats: TierStats, n_experts: int,
                 nbytes: dict[int, int], cached_layers: set[int], tracer=None, disk_homes=None, submit=None):
        self.predictors, self.cache, self.stats = predictors, cache, stats
        self.n_experts, self.nbytes, self.cached_layers = n_experts, nbytes, cached_layers
        self.tracer = tracer  # records each prediction, so `strata cache-sim` replays the prefetches
        self.disk_homes = disk_homes or {}  # layer -> DiskHome: predictions are read ahead into its RAM cache
        self.riding: dict[int, tuple[int, torch.Tensor]] = {}  # block -> (layer, device ids) for its read
        # a worker pool's submit(fn, *args) -> Future for CPU predictions; none with a device cache,
        # whose bookkeeping stays on the calling thread
        self.submit = submit if cache is None else None
        self.pending = None  # the Future of a prediction still running on a worker

    def __call__(self, block: int, x: torch.Tensor, token_mask: torch.Tensor, prefill: bool = False) -> None:
        self.settle()
        layer = block + 1
        predict = self.predictors.get(layer)
        if predict is None:
            return
        rows = _real_rows(x, token_mask)  # (N, hidden) for the real tokens
        if self.submit is not None and rows.device.type == "cpu":
            self.pending = self.submit(self._predict_and_issue, predict, layer, rows, prefill)
            return
        with torch.inference_mode():
            ids = predict(rows)  # (N, k)
        if ids.device.type == "cpu":
            self.issue(layer, ids, prefill)
        else:
            self.riding[block] = (layer, ids)

    def _predict_and_issue(self, predict, layer: int, rows: torch.Tensor, prefill: bool) -> None:
        with torch.inference_mode():
            self.issue(layer, predict(rows), prefill)

    def settle(self) -> None:
        """Wait for a prediction running on a worker (its error, if any, is raised here)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def take(self, block: int) -> tuple[int, torch.Tensor] | None:
        """(layer, device ids) predicted before `block`, for the block's routing read to carry."""
        return self.riding.pop(block, None)

    def issue(self, layer: int, ids: torch.Tensor, prefill: bool = False, after=None) -> None:
        """Prefetch `layer`'s predicted experts (host ids); `after`: the compute-stream event the
        slot writes wait for (the kernels queued so far may read a slot being replaced)."""
        experts = torch.unique(ids).tolist()
        if self.tracer is not None:
            self.tracer.predicted(layer, experts, SOURCE)
        keys = [layer * self.n_experts + e for e in experts]
        self.stats.predicted(layer, set(keys))
        home = self.disk_homes.get(layer)
        if home is not None:  # reads start now, while this block computes
            home.request(layer, _read_ahead(ids, experts, prefill, home.readers), ahead=True)
        if self.cache is not None and layer in self.cached_layers:
            self.stats.prefetched(layer, self.cache.prefetch(keys, prefill, after), self.nbytes[layer])


def _read_ahead(ids: torch.Tensor, experts: list[int], prefill: bool, readers: int) -> list[int]:
    """The predicted experts a disk home reads ahead: all of a decode step's; of a prompt's, only the
    2 x `readers` that most of its tokens predicted. A prompt's layer demands hundreds of experts,
    whose own reads keep the disk busy; the read ahead need only cover the layer boundary, and all
    of it wasted a fifth of the full-size flagship's first-prompt reads (3.53 of 18.09 GiB, 32
    tokens), read before the first token."""
    cap = 2 * readers
    if not prefill or len(experts) <= cap:
        return experts
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=max(experts) + 1)
    return sorted(torch.argsort(counts, descending=True, stable=True)[:cap].tolist())


def _real_rows(x: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """(N, hidden) rows of x at the real positions; the host mask becomes host indices, so a device
    x is gathered without a read back (a boolean index on the device waits for its count)."""
    flat = x.reshape(-1, x.shape[-1])
    mask = token_mask.reshape(-1)
    if bool(mask.all()):  # host bookkeeping: every position is real (decode): no gather
        return flat
    if x.device.type == "cpu":
        return flat[mask.to(x.device)]
    return flat.index_select(0, to_device(mask.nonzero().reshape(-1), x.device))


def router_predictors(model) -> dict[int, Callable]:
    """Per MoE block: hidden state -> expert ids, by that block's own norm and router."""
    from strata.models.transformer import MoE

    out = {}
    for i, block in enumerate(getattr(model, "blocks", [])):
        ffn = getattr(block, "ffn", None)
        if isinstance(ffn, MoE) and hasattr(block, "ffn_norm"):
            out[i] = _predictor(block)
    return out


def _predictor(block) -> Callable:
    """A norm that offers `ungated` (qwen4exp's hyper-connection mixer) is applied without its
    gate's products: a prediction may be approximate, and the full mix cost a third of the
    model's hyper-connection work again on every decoded token."""
    norm = getattr(block.ffn_norm, "ungated", block.ffn_norm)

    def predict(h: torch.Tensor) -> torch.Tensor:
        h = h.to(block.ffn.router.device)
        x = norm(h)
        # one thread, as the block's own router product: a decode row's product (2560 x 512) on
        # torch's OpenMP team left the team's other thread spinning after every layer's call
        # (13 % of the full-size flagship's decode CPU)
        with one_thread_if_small(x.numel() * block.ffn.router.shape[0], x.device):
            logits = F.linear(x, block.ffn.router)
        return block.ffn.route(logits)[0]
    return predict
