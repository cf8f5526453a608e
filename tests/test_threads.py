"""A decode step's small torch products run on one thread (kernels/threads.py), so a descheduled
OpenMP thread on shared cores cannot stall them; large ones keep torch's team."""

import pytest
import torch
import torch.nn.functional as F

import strata
from strata.kernels.threads import SMALL_WORK, one_thread_if_small
from tiny import write_tiny_llama


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_small_cpu_work_runs_on_one_thread_and_restores(two_threads):
    with one_thread_if_small(SMALL_WORK):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError):
        with one_thread_if_small(10):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_large_or_device_work_keeps_the_team(two_threads):
    with one_thread_if_small(SMALL_WORK + 1):
        assert torch.get_num_threads() == 2
    with one_thread_if_small(10, "meta"):
        assert torch.get_num_threads() == 2


def test_decode_attention_and_router_run_on_one_thread(tmp_path, monkeypatch, two_threads):
    engine = strata.load(write_tiny_llama(tmp_path / "tiny.gguf"), cpu_threads=2, draft="off")
    seen = {"attention": [], "router": []}
    sdpa, linear = F.scaled_dot_product_attention, F.linear

    def attention(*a, **k):
        seen["attention"].append(torch.get_num_threads())
        return sdpa(*a, **k)

    def product(x, w, *a, **k):
        if w.shape[0] == engine.config.n_experts:
            seen["router"].append(torch.get_num_threads())
        return linear(x, w, *a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", attention)
    monkeypatch.setattr(F, "linear", product)
    engine.generate([5, 6, 7], max_new_tokens=4, stop_at_eos=False)
    assert seen["attention"] and set(seen["attention"]) == {1}
    assert seen["router"] and set(seen["router"]) == {1}
    assert torch.get_num_threads() == 2
