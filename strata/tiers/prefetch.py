"""Prefetch: while layer L runs, layer L+1's router applied to L's input names its experts.

The residual stream changes little from one layer to the next, so the next router's
choice on the current hidden state is a good guess; predicted misses are copied in on
the copy stream (a thread without CUDA) while layer L's attention and experts compute.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from strata.tiers.stats import TierStats

SOURCE = "Strata's prefetcher (layer L+1's router on layer L's input)"


class Prefetcher:
    def __init__(self, predictors: dict[int, Callable], cache, stats: TierStats, n_experts: int,
                 nbytes: dict[int, int], cached_layers: set[int], tracer=None, disk_homes=None):
        self.predictors, self.cache, self.stats = predictors, cache, stats
        self.n_experts, self.nbytes, self.cached_layers = n_experts, nbytes, cached_layers
        self.tracer = tracer  # records each prediction, so `strata cache-sim` replays the prefetches
        self.disk_homes = disk_homes or {}  # layer -> DiskHome: predictions are read ahead into its RAM cache

    def __call__(self, block: int, x: torch.Tensor, token_mask: torch.Tensor, prefill: bool = False) -> None:
        layer = block + 1
        predict = self.predictors.get(layer)
        if predict is None:
            return
        with torch.inference_mode():
            ids = predict(x[token_mask])  # (N, k) for the real tokens
        experts = torch.unique(ids).tolist()
        if self.tracer is not None:
            self.tracer.predicted(layer, experts, SOURCE)
        keys = [layer * self.n_experts + e for e in experts]
        self.stats.predicted(layer, set(keys))
        home = self.disk_homes.get(layer)
        if home is not None:  # reads start now, while this block computes
            home.request(layer, experts, ahead=True)
        if self.cache is not None and layer in self.cached_layers:
            self.stats.prefetched(layer, self.cache.prefetch(keys, prefill), self.nbytes[layer])


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
    def predict(h: torch.Tensor) -> torch.Tensor:
        h = h.to(block.ffn.router.device)
        return block.ffn.route(F.linear(block.ffn_norm(h), block.ffn.router))[0]
    return predict
