"""The tiers on a real GPU: slots in device memory, copies from pinned RAM on a copy stream."""

from __future__ import annotations

import pytest
import torch

import strata
from strata.models.layers import Experts
from strata.tiers.executor import TieredExperts
from test_tiers import check_exact, model  # noqa: F401  (the module-scoped model fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("options", [
    dict(experts_cache="0"), dict(experts_cache="30%"), dict(experts_cache="100%"),
    dict(experts_cache="30%", pin_experts="disk", cache_policy="lru"),
    dict(experts_cache="50%", gpu_layers="1", prefill_reserve=2),
    dict(experts_cache="30%", override_tensor=(r"blk\.0\.ffn_.*_exps=gpu",)),
])
def test_gpu_tiers_are_exact(model, options):  # noqa: F811
    path, ids, ref_logits, ref_tokens, _ = model
    engine = strata.load(path, **options)
    tiers = engine.tiers
    if tiers.cache is not None:
        assert tiers.cache.memory.data.is_cuda and tiers.cache.memory.stream is not None
    ram = [h for h in tiers.homes.values() if h.kind == "ram"]
    assert all(t.is_pinned() for h in ram for ts in h.data.values() for t in ts)
    check_exact(engine, ids, ref_logits, ref_tokens)
    engine.close()


def test_gpu_layers_move_blocks(model):  # noqa: F811
    path, ids, ref_logits, ref_tokens, _ = model
    engine = strata.load(path, experts_cache="30%", gpu_layers="all")
    block = engine.model.blocks[0]
    assert block.attn.wq.device.type == "cuda" and block.ffn.router.is_cuda
    assert all(isinstance(m.backend, TieredExperts) for m in engine.model.modules() if isinstance(m, Experts))
    check_exact(engine, ids, ref_logits, ref_tokens)
    engine.close()
