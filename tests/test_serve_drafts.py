"""The server drafts with the MTP head (`--draft on`), for a lone request and for every row of a
batch: greedy output served with drafts equals the output served without them, and the
scheduler's draft counters show the rounds (and batched verify passes) really ran.

On the trained demo, dense weights are float16 and multiplied in float16, so a row's logits in a
batch (or in a verify pass of k+1 positions) may differ from the same row's alone by one or two
float16 ulps (2^-8 at |logit| 4..8): a greedy choice can then flip only where the top two
logits are that close. `tie_or_equal` accepts a difference only there, judged by a serial
forward of the common prefix.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import strata
from strata.runtime.scheduler import Scheduler
from test_speculative import N_OUT, PROMPTS, Oracle, _plain, checkpoint  # noqa: F401 (a fixture)

DEMO = Path(strata.__file__).parent / "demo" / "strata-demo.gguf"


def test_scheduler_drafts_a_lone_request_and_greedy_output_is_unchanged(checkpoint):  # noqa: F811
    *_, paths = checkpoint
    engine = strata.load(paths["gguf"], draft="on", draft_tokens=3)
    with Scheduler(engine) as sched:
        for ids in PROMPTS:
            req = sched.submit(ids, N_OUT, ignore_eos=True)
            req.text()
            assert req.token_ids == _plain(paths["gguf"], tuple(ids), N_OUT)
        d = sched.stats()["draft"]
        assert d["rounds"] > 0 and d["drafted"] >= d["accepted"] and d["draft_tokens"] == 3


def test_oracle_drafts_are_all_kept_and_limits_hold_mid_round(checkpoint):  # noqa: F811
    """A head that copies the model: k+1 tokens per step, and a limit inside a round is kept."""
    *_, paths = checkpoint
    ids = PROMPTS[0]
    plain = _plain(paths["gguf"], tuple(ids), N_OUT)
    engine = strata.load(paths["gguf"], draft_tokens=4)
    engine.drafter = Oracle(ids, plain)
    for n in (1, 3, 7, N_OUT):
        with Scheduler(engine) as sched:
            req = sched.submit(ids, n, ignore_eos=True)
            req.text()
            s = sched.stats()
        assert req.token_ids == plain[:n] and req.finish_reason == "length"
        assert s["draft"]["drafted"] <= n and s["draft"]["accepted"] == s["draft"]["drafted"]
        assert s["decode_steps"] <= -(-(n - 1) // 5)  # ceil((n-1) / (k+1)) rounds after the first token


def test_a_request_joining_a_drafting_one_drafts_too_and_both_stay_exact(checkpoint):  # noqa: F811
    *_, paths = checkpoint
    engine = strata.load(paths["gguf"], draft="on", draft_tokens=2)
    a_ids, b_ids = PROMPTS[0], PROMPTS[1]
    with Scheduler(engine) as sched:
        a = sched.submit(a_ids, N_OUT, ignore_eos=True)
        next(iter(a))  # a runs (and drafts) alone
        b = sched.submit(b_ids, N_OUT, ignore_eos=True)
        a.text(), b.text()
        d = sched.stats()["draft"]
    assert a.token_ids == _plain(paths["gguf"], tuple(a_ids), N_OUT)
    assert b.token_ids == _plain(paths["gguf"], tuple(b_ids), N_OUT)
    assert d["passes"] < d["rounds"]  # some verify passes judged both rows' drafts


# float16 logits: one ulp is 2^-10 of the leading power of two. Teacher-forced on the demo (8 rows
# x 24 steps, drafts off), a row's logits in the batch were 1 ulp off its logits alone at the
# median step and 2 ulps at most; twice that is the tie tolerance.
TIE_ULPS = 4


def tie_or_equal(engine, prompt: list[int], a: list[int], b: list[int]) -> str | None:
    """None when greedy outputs `a` and `b` agree, or first differ at a genuine tie: a serial
    forward of prompt + the common prefix puts both choices within TIE_ULPS float16 ulps of the
    top logit. Else a description of the difference."""
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return None if len(a) == len(b) else f"lengths {len(a)} and {len(b)}"
    with torch.inference_mode():
        logits = engine.model(torch.tensor([prompt + a[:i]]), engine.model.new_cache(1), last_only=True)[0, -1]
    top = float(logits.max())
    tol = TIE_ULPS * 2.0 ** (math.floor(math.log2(max(abs(top), 2 ** -14))) - 10)
    la, lb = float(logits[a[i]]), float(logits[b[i]])
    if top - min(la, lb) <= tol:
        return None
    return f"token {i}: {a[i]} (logit {la:.4f}) vs {b[i]} (logit {lb:.4f}), top {top:.4f}, tolerance {tol:.4f}"


class RecordingScheduler(Scheduler):
    """The server's scheduler, keeping each request so a test can read its token ids."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.requests = []

    def submit(self, *args, **kwargs):
        req = super().submit(*args, **kwargs)
        self.requests.append(req)
        return req


@pytest.mark.skipif(not DEMO.exists(), reason="demo model missing")
def test_concurrent_served_greedy_text_with_drafts_equals_without():
    """Through the OpenAI-compatible app, on the trained demo (its MTP head agrees often), 8
    requests at once on 4 slots: served with drafts (every batch row drafting) equals served
    without, and both equal each prompt decoded alone, up to genuine ties."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from strata.serve.app import create_app
    from test_serve import serving

    prompts = [f"def {name}(path):\n" for name in
               ("main", "read_config", "load", "parse_args", "walk", "checksum", "merge", "to_json")]
    import httpx

    texts, ids, stats, metrics = {}, {}, {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: threads only contend (the scheduler copies this)
    try:
        for draft in ("on", "off"):
            engine = strata.load(DEMO, draft=draft)
            sched = RecordingScheduler(engine, max_concurrent=4)
            app = create_app(engine, "demo", scheduler=sched)
            with serving(app) as url:
                client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)

                def ask(p):
                    return client.completions.create(model="demo", prompt=p, max_tokens=16,
                                                     temperature=0).choices[0].text

                with ThreadPoolExecutor(len(prompts)) as pool:
                    texts[draft] = list(pool.map(ask, prompts))
                metrics[draft] = httpx.get(url + "/metrics").text
            stats[draft] = sched.stats()
            ids[draft] = {tuple(r.prompt): r.token_ids for r in sched.requests}
        alone = {p: engine.generate(p, 16) for p in ids["off"]}  # drafts off, one at a time
    finally:
        torch.set_num_threads(threads)
    assert all(texts["on"]) and all(texts["off"])
    for p in alone:
        for got in (ids["on"][p], ids["off"][p]):
            assert tie_or_equal(engine, list(p), got, alone[p]) is None, tie_or_equal(engine, list(p), got, alone[p])
        assert tie_or_equal(engine, list(p), ids["on"][p], ids["off"][p]) is None
    d = stats["on"]["draft"]
    assert stats["off"]["draft"] is None and d["rounds"] > 0 and d["accepted"] > 0
    assert d["passes"] < d["rounds"]  # batch rows drafted together
    assert f"strata_draft_accepted_tokens_total {d['accepted']}" in metrics["on"].splitlines()
    assert "strata_draft_" not in metrics["off"]
    assert stats["on"]["decode_steps"] < stats["off"]["decode_steps"]  # accepted drafts saved steps


def test_batch_rows_with_limits_inside_rounds_stay_exact(checkpoint):  # noqa: F811
    """Rows of one drafting batch with different limits: each row drafts k_r <= k (fewer near its
    end), the verify pass right-pads them, and each keeps its own prefix."""
    *_, paths = checkpoint
    engine = strata.load(paths["gguf"], draft="on", draft_tokens=3)
    limits = [1, 3, 7, N_OUT]
    with Scheduler(engine, max_concurrent=4) as sched:
        reqs = [sched.submit(ids, n, ignore_eos=True) for ids in PROMPTS for n in limits]
        for r in reqs:
            r.text()
        d = sched.stats()["draft"]
    for r, (ids, n) in zip(reqs, [(ids, n) for ids in PROMPTS for n in limits]):
        assert r.token_ids == _plain(paths["gguf"], tuple(ids), N_OUT)[:n] and r.finish_reason == "length"
    assert d["passes"] < d["rounds"] and d["drafted"] > 0
