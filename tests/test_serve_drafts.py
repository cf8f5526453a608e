"""The server drafts with the MTP head (`--draft on`): greedy output served with drafts equals the
output served without them, and the scheduler's draft counters show the rounds really ran."""

from __future__ import annotations

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


def test_a_request_joining_stops_the_drafts_and_both_stay_exact(checkpoint):  # noqa: F811
    *_, paths = checkpoint
    engine = strata.load(paths["gguf"], draft="on", draft_tokens=2)
    a_ids, b_ids = PROMPTS[0], PROMPTS[1]
    with Scheduler(engine) as sched:
        a = sched.submit(a_ids, N_OUT, ignore_eos=True)
        next(iter(a))  # a runs (and drafts) alone
        b = sched.submit(b_ids, N_OUT, ignore_eos=True)
        a.text(), b.text()
    assert a.token_ids == _plain(paths["gguf"], tuple(a_ids), N_OUT)
    assert b.token_ids == _plain(paths["gguf"], tuple(b_ids), N_OUT)


@pytest.mark.skipif(not DEMO.exists(), reason="demo model missing")
def test_served_greedy_text_with_drafts_equals_without():
    """Through the OpenAI-compatible app, on the trained demo (its MTP head agrees often)."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from strata.serve.app import create_app
    from test_serve import serving

    texts, stats = {}, {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: threads only contend (the scheduler copies this)
    for draft in ("on", "off"):
        engine = strata.load(DEMO, draft=draft)
        app = create_app(engine, "demo")
        with serving(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            texts[draft] = [client.completions.create(model="demo", prompt=p, max_tokens=24, temperature=0)
                            .choices[0].text for p in ("def main():\n", "import os\nimport sys\n")]
        stats[draft] = app.state.scheduler.stats()["draft"]
    torch.set_num_threads(threads)
    assert texts["on"] == texts["off"] and all(texts["on"])
    assert stats["off"] is None and stats["on"]["rounds"] > 0 and stats["on"]["accepted"] > 0
