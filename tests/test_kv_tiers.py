"""Tiered KV (`--kv-device`): bounded device blocks, the rest in host RAM, same output as untiered."""

from __future__ import annotations

import pytest
import torch
from reference import prompt, save_hf
from tiny import write_tiny_llama

import strata
from strata.errors import BadOption
from strata.tiers import kv_tiers
from strata.tiers.kv_tiers import TieredKVCache, TieredQSACache, model_device_bytes

BLOCK = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("kv") / "llama.gguf", context_length=256)


@pytest.fixture(scope="module")
def qwen4exp_paths(tmp_path_factory):
    from test_qwen4exp import tiny_qwen4exp

    from strata.gguf.convert import convert_hf_to_gguf

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("qwen4exp-kv")
    save_hf(tiny_qwen4exp(), d / "hf")
    convert_hf_to_gguf(d / "hf", d / "model.gguf")
    return d / "model.gguf"


def _tiered(path, budget: str, block: int = BLOCK, **options):
    """An engine built with the tiered KV factory (`--kv-device budget`), in blocks of `block` tokens."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_tiers, "DEFAULT_BLOCK", block)
        return strata.load(path, kv_device_budget=budget, **options)


def _watch_device_bytes(model, limit: int):
    """Wrap every tiered cache's `attend` to check its pool never passes the per-layer share."""
    seen = []
    orig = TieredKVCache.attend

    def attend(self, *a, **kw):
        out = orig(self, *a, **kw)
        seen.append(self.device_bytes)
        assert self.device_bytes <= self.config.budget <= limit
        return out

    return seen, attend


def _per_layer(engine) -> int:
    """Attention layers the budget is split over (`TieredKV.configure` gives each an equal share)."""
    from strata.models.layers import Attention

    return sum(isinstance(m, Attention) for m in engine.model.modules())


@pytest.mark.parametrize("budget_blocks", [1, 2, 5])
def test_dense_logits_and_greedy_equal_untiered(tiny_llama, monkeypatch, budget_blocks):
    ids = prompt(258, 100, seed=3)
    plain = strata.load(tiny_llama)
    want_logits = plain.logits(ids)
    want = plain.generate(ids, max_new_tokens=20, stop_at_eos=False)
    one_block = kv_tiers.block_bytes(2, 8, BLOCK, torch.float32)  # tiny llama: 2 KV heads of 8
    budget = budget_blocks * one_block * _per_layer(plain)
    engine = _tiered(tiny_llama, str(budget), prefill_chunk=24)
    seen, attend = _watch_device_bytes(engine.model, budget)
    monkeypatch.setattr(TieredKVCache, "attend", attend)
    cache = engine.model.new_cache(1)
    assert all(isinstance(c, TieredKVCache) for c in cache.layers)
    torch.testing.assert_close(engine.logits(ids), want_logits, atol=1e-5, rtol=1e-5)
    assert engine.generate(ids, max_new_tokens=20, stop_at_eos=False) == want
    assert seen and max(seen) <= budget_blocks * one_block


def test_dense_batch_select_extend_equal_untiered(tiny_llama):
    prompts = [prompt(258, n, seed=n) for n in (70, 13, 41)]
    plain = strata.load(tiny_llama)
    want = plain.generate(prompts, max_new_tokens=10, stop_at_eos=False)
    engine = _tiered(tiny_llama, str(4 * kv_tiers.block_bytes(2, 8, BLOCK, torch.float32) * 2), prefill_chunk=16)
    assert engine.generate(prompts, max_new_tokens=10, stop_at_eos=False) == want
    # continuous batching: prefill alone, merge, decode, drop a row
    model = engine.model
    with torch.inference_mode():
        caches, firsts = [], []
        for p in prompts[:2]:
            c = model.new_cache(1)
            firsts.append(model(torch.tensor([p]), c, last_only=True)[:, 0].argmax(-1, keepdim=True))
            caches.append(c)
        merged = caches[0]
        merged.extend(caches[1])
        tokens, outs = torch.cat(firsts), []
        for _ in range(4):
            outs.append(tokens[:, 0].tolist())
            tokens = model(tokens, merged, last_only=True)[:, 0].argmax(-1, keepdim=True)
        merged.select(torch.tensor([1]))
        tokens = tokens[1:]
        for _ in range(3):
            outs.append([None, tokens[0, 0].item()])
            tokens = model(tokens, merged, last_only=True)[:, 0].argmax(-1, keepdim=True)
    assert [o[0] for o in outs[:4]] == want[0][:4]
    assert [o[1] for o in outs] == want[1][:7]
    assert model_device_bytes(merged) > 0


def test_qwen4exp_qsa_logits_and_greedy_equal_untiered(qwen4exp_paths, monkeypatch):
    from test_qwen4exp import eos_prompt

    ids = eos_prompt(80, seed=2)
    plain = strata.load(qwen4exp_paths)
    want_logits = plain.logits(ids)
    want = plain.generate(ids, max_new_tokens=24, stop_at_eos=False)
    one_block = kv_tiers.block_bytes(2, 16, BLOCK, torch.float32)
    budget = 3 * one_block * _per_layer(plain)  # 1 resident block + 2 staging per layer
    engine = _tiered(qwen4exp_paths, str(budget), prefill_chunk=32)
    cache = engine.model.new_cache(1)
    qsa = [getattr(c, "mixer", c) for c in cache.layers]
    qsa = [c for c in qsa if isinstance(c, TieredQSACache)]
    assert qsa and any(c.frequency for c in qsa)
    seen, attend = _watch_device_bytes(engine.model, budget)
    monkeypatch.setattr(TieredKVCache, "attend", attend)
    got = engine.logits(ids)
    assert (got - want_logits).abs().max().item() < 1e-4
    assert engine.generate(ids, max_new_tokens=24, stop_at_eos=False) == want
    assert seen and max(seen) <= 3 * one_block


def test_qsa_keeps_the_most_selected_blocks_resident(qwen4exp_paths):
    from test_qwen4exp import eos_prompt

    one_block = kv_tiers.block_bytes(2, 16, 4, torch.float32)
    engine = _tiered(qwen4exp_paths, str(6 * one_block * _per_layer(strata.load(qwen4exp_paths))), block=4)
    cache = engine.model.new_cache(1)
    with torch.inference_mode():
        engine.model(torch.tensor([eos_prompt(80, seed=2)]), cache)
    for c in cache.layers:
        c = getattr(c, "mixer", c)
        if isinstance(c, TieredQSACache) and c.frequency:
            row = c.rows[0]
            ranked = sorted(row.counts, key=lambda j: (row.counts[j], j), reverse=True)
            assert set(row.resident) == set(ranked[:c.n_resident])
            assert len(row.counts) > c.n_resident  # some blocks were fetched on demand


def test_engine_option_and_cli_flag(tiny_llama):
    from strata.runtime.run_cli import engine_options, parser

    args = parser().parse_args(["-m", str(tiny_llama), "--kv-device", "64M", "-p", "x"])
    opts = engine_options(args)
    assert opts["kv_device_budget"] == "64M"
    engine = strata.load(tiny_llama, **opts)
    cache = engine.model.new_cache(1)
    assert all(isinstance(c, TieredKVCache) for c in cache.layers)
    ids = prompt(258, 30, seed=1)
    assert engine.generate(ids, 5, stop_at_eos=False) == strata.load(tiny_llama).generate(ids, 5, stop_at_eos=False)


@pytest.mark.parametrize("bad", ["0", "-5M", "lots", "1K"])
def test_bad_budget_names_the_flag(tiny_llama, bad):
    with pytest.raises(BadOption, match="--kv-device"):
        strata.load(tiny_llama, kv_device_budget=bad)


def test_rollback_then_rewrite_equals_untiered(tiny_llama):
    """Speculative decoding's undo: drop positions, write others over them (resident copies refresh)."""
    ids = prompt(258, 40, seed=5)
    plain = strata.load(tiny_llama)
    engine = _tiered(tiny_llama, str(3 * kv_tiers.block_bytes(2, 8, BLOCK, torch.float32) * 2))
    outs = []
    for e in (plain, engine):
        model = e.model
        with torch.inference_mode():
            cache = model.new_cache(1)
            model(torch.tensor([ids]), cache)
            model(torch.tensor([[7, 8, 9, 10, 11]]), cache)
            cache.rollback(4)
            outs.append(model(torch.tensor([[12, 13, 14]]), cache))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def qwen3next_mtp(tmp_path_factory):
    from safetensors.torch import save_file
    from test_qwen3next import tiny_qwen3next
    from test_speculative import tiny_mtp

    from strata.gguf.convert import convert_hf_to_gguf

    torch.manual_seed(0)
    model = tiny_qwen3next()
    d = tmp_path_factory.mktemp("qwen3next-kv")
    _, tensors = tiny_mtp(model, d / "aux")
    save_hf(model, d / "hf")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "hf" / "mtp.safetensors"))
    convert_hf_to_gguf(d / "hf", d / "model.gguf")
    return d / "model.gguf"


def test_speculative_decoding_with_tiered_kv_equals_plain(qwen3next_mtp):
    """Drafts, verify passes and rollbacks over tiered caches (the MTP block's included)."""
    from test_speculative import PROMPTS

    plain = strata.load(qwen3next_mtp, draft="off")
    attn = _per_layer(plain)
    from strata.models.layers import Attention

    a = next(m for m in plain.model.modules() if isinstance(m, Attention))
    engine = _tiered(qwen3next_mtp, str(2 * kv_tiers.block_bytes(a.n_kv, a.head_dim, 4, torch.float32) * attn),
                     block=4, draft="on", draft_tokens=3)
    assert engine.drafter.new_cache(1).layers and isinstance(engine.drafter.new_cache(1).layers[0], TieredKVCache)
    for ids in PROMPTS[:2]:
        assert engine.generate(ids, 20, stop_at_eos=False) == plain.generate(ids, 20, stop_at_eos=False)
        assert engine.stats["draft"]["rounds"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: the portable (CUDA) path
def test_block_attention_merges_to_full_attention(dtype):
    """Blocks attended one by one and merged by log-sum-exp equal one softmax over all keys."""
    from strata.tiers.kv_tiers import _block_attention, merge

    g = torch.Generator().manual_seed(0)
    h, grp, n, d, s = 2, 2, 5, 8, 24
    q = torch.randn(h, grp * n, d, generator=g, dtype=dtype)
    k, v = torch.randn(h, s, d, generator=g, dtype=dtype), torch.randn(h, s, d, generator=g, dtype=dtype)
    ok = torch.rand(n, s, generator=g) > 0.4
    ok[:, 0] = True
    ok[:, 8:16] = False  # a block no query sees
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(h, grp, n, d), k[:, None], v[:, None], attn_mask=ok).reshape(h, grp * n, d)
    out = lse = None
    for lo in range(0, s, 8):
        o, l = _block_attention(q, k[:, lo:lo + 8], v[:, lo:lo + 8], ok[:, lo:lo + 8], grp)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    torch.testing.assert_close(out.to(dtype), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qsa", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_tiered_attention_equals_one_softmax_over_all_keys(qsa, batch):
    """Prefill chunks (block by block), decode and verify steps (two parts, pool and host memory,
    merged by log-sum-exp) and a rollback, rows of different lengths: each step's output equals
    one softmax over every key its query may see (causal, and an indexer-like random choice)."""
    from strata.models.cache import ModelCache

    g = torch.Generator().manual_seed(batch + 2 * qsa)
    hq, h, d, blk = 4, 2, 8, 4
    cache = TieredKVCache(kv_tiers.KVTierConfig(5 * kv_tiers.block_bytes(h, d, blk, torch.float32), blk),
                          frequency=qsa)
    steps = ModelCache([cache], batch)
    keys, values = torch.zeros(batch, h, 128, d), torch.zeros(batch, h, 128, d)
    plan = [(24, [24, 13]), (20, [20, 20]), (1, [1, 1]), (3, [3, 2]), ("rollback", 2), (1, [1, 0]),
            (3, [3, 3])] + [(1, [1, 1])] * 6
    split_with_both_parts = 0
    for width, n_new in plan:
        if width == "rollback":
            steps.rollback(n_new)
            continue
        step = steps.step(width, torch.tensor(n_new[:batch]))
        q = torch.randn(batch, hq, width, d, generator=g)
        k, v = torch.randn(batch, h, width, d, generator=g), torch.randn(batch, h, width, d, generator=g)
        n_keys = int((step.start + width).max())
        allowed = None
        if qsa:
            allowed = torch.rand(batch, 1, width, n_keys, generator=g) > 0.5
            allowed |= (torch.arange(n_keys)[None, None] == step.positions[:, :, None])[:, None]  # sees itself
        for r in range(batch):
            keys[r, :, step.start[r]:step.start[r] + step.n_new[r]] = k[r, :, :step.n_new[r]]
            values[r, :, step.start[r]:step.start[r] + step.n_new[r]] = v[r, :, :step.n_new[r]]
        got = cache.attend(q, k, v, step, allowed)
        if width == 1:
            row = cache.rows[0]
            split_with_both_parts += 0 < len(row.resident) < -(-row.n // blk)
        for r in range(batch):
            n, end = int(step.n_new[r]), int(step.start[r] + step.n_new[r])
            mask = step.attention_mask(end)[r, :, :n]  # (1, n, S)
            if allowed is not None:
                mask = mask & allowed[r, :, :n, :end]
            want = torch.nn.functional.scaled_dot_product_attention(
                q[r:r + 1, :, :n], keys[r:r + 1, :, :end], values[r:r + 1, :, :end], attn_mask=mask[None],
                enable_gqa=True)[0]
            torch.testing.assert_close(got[r, :, :n], want, atol=1e-5, rtol=1e-5)
            assert not got[r, :, n:].any()
        steps.advance(step)
        assert cache.device_bytes <= cache.config.budget
    assert split_with_both_parts > 0
