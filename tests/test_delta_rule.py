"""The C step of the gated delta rule (kernels.delta_rule) against the torch recurrence in float64."""

import pytest
import torch

from strata import kernels
from strata.kernels import _build
from strata.kernels.delta_rule import try_gdn_step
from strata.models.gated_deltanet import gated_delta_rule

pytestmark = pytest.mark.skipif(_build.load() is None, reason="no C kernels on this machine")


def _inputs(b=2, t=1, hk=2, hv=4, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=g)
    gate = -torch.rand(b, t, hv, generator=g)
    beta = torch.rand(b, t, hv, generator=g)
    gate[1, -1], beta[1, -1] = 0.0, 0.0  # a padded position: the state passes through unchanged
    state = torch.randn(b, hv, dk, dv, generator=g)
    return q, k, v, gate, beta, state


def test_one_step_matches_the_torch_step_in_float64():
    n, dk, dv = 6, 32, 40
    g = torch.Generator().manual_seed(1)
    state, q, k, v = torch.randn(n, dk, dv, generator=g), torch.randn(n, dk, generator=g), \
        torch.randn(n, dk, generator=g), torch.randn(n, dv, generator=g)
    decay, beta = torch.rand(n, generator=g), torch.rand(n, generator=g)
    s = state.double() * decay.double()[:, None, None]
    delta = (v.double() - torch.einsum("nk,nkv->nv", k.double(), s)) * beta.double()[:, None]
    s = s + k.double()[:, :, None] * delta[:, None, :]
    want = torch.einsum("nk,nkv->nv", q.double(), s)
    got = try_gdn_step(state, q, k, v, decay, beta)  # in place
    assert got is not None
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)
    assert torch.allclose(state.double(), s, atol=1e-5, rtol=1e-5)


def test_one_step_with_a_subnormal_decay_matches_float64():
    """A head whose decay is under float32's normal range (the C step drops S * d, which would be
    subnormal arithmetic) still gives the float64 step's result; other heads are untouched."""
    n, dk, dv = 4, 32, 40
    g = torch.Generator().manual_seed(2)
    state, q, k, v = torch.randn(n, dk, dv, generator=g), torch.randn(n, dk, generator=g), \
        torch.randn(n, dk, generator=g), torch.randn(n, dv, generator=g)
    decay = torch.tensor([-95.0, -0.3, -88.0, -87.0]).exp()  # exp(-95), exp(-88) subnormal; exp(-87) normal
    beta = torch.rand(n, generator=g)
    s = state.double() * decay.double()[:, None, None]
    delta = (v.double() - torch.einsum("nk,nkv->nv", k.double(), s)) * beta.double()[:, None]
    s = s + k.double()[:, :, None] * delta[:, None, :]
    want = torch.einsum("nk,nkv->nv", q.double(), s)
    got = try_gdn_step(state, q, k, v, decay, beta)
    assert got is not None
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)
    assert torch.allclose(state.double(), s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [1, 3])
def test_recurrence_through_the_kernel_equals_torch_and_keeps_the_start_state_unless_in_place(monkeypatch, t):
    q, k, v, gate, beta, state = _inputs(t=t)
    monkeypatch.setattr(kernels, "USE_KERNELS", False)
    want, want_state = gated_delta_rule(q, k, v, gate, beta, state.clone(), recurrent=True)
    monkeypatch.setattr(kernels, "USE_KERNELS", True)
    start = state.clone()
    steps = []
    out, new = gated_delta_rule(q, k, v, gate, beta, state, recurrent=True, steps=steps)
    assert torch.equal(state, start)  # not in place: the caller's state (a rollback's start) is kept
    assert torch.allclose(out, want, atol=1e-5) and torch.allclose(new, want_state, atol=1e-5)
    assert len(steps) == t and len({s.data_ptr() for s in steps}) == t and torch.equal(steps[-1], new)
    if t > 1:  # the padded last position of row 1 left its state exactly as the step before
        assert torch.equal(steps[-1][1], steps[-2][1])
    out2, new2 = gated_delta_rule(q, k, v, gate, beta, state, recurrent=True, in_place=True)
    assert torch.equal(out2, out) and torch.equal(new2, new)
    assert torch.equal(state, new) and new2.data_ptr() == state.data_ptr()  # written into the cache's own state


def test_a_prompts_chunked_rule_runs_on_one_torch_thread(monkeypatch):
    """At 2 threads each of the chunked form's small torch ops waits at an OpenMP barrier (a pp512
    layer took 5x the CPU of one thread on a shared machine): it runs on one, and the count is back after."""
    import strata.models.gated_deltanet as gdn

    seen = []
    real = gdn.chunk_gated_delta_rule
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v, gate, beta, state = _inputs(t=5)
        gated_delta_rule(q, k, v, gate, beta, state, chunk=4)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dv", [48, 64])  # 16-column blocks; 32-column blocks
def test_a_prompts_rule_in_c_matches_transformers_in_float64(dv, monkeypatch):
    """A prompt's positions through the C recurrence (gdn_prompt.c: 300 tokens, three blocks of
    them; q, k, v strided views of one projection; value heads sharing key heads; a right-padded
    row) against transformers' own recurrence run in float64; the caller's state is kept. With
    the C call's buffer refused (prefill.c's test hook) the chunked torch form computes it."""
    import ctypes

    import strata.models.gated_deltanet as gdn
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(dv)
    b, t, hk, hv, dk = 2, 300, 2, 4, 32
    qkv = torch.randn(b, t, 2 * hk * dk + hv * dv, generator=g)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(b, t, hk, dk), k.view(b, t, hk, dk), v.view(b, t, hv, dv)
    gate = -torch.rand(b, t, hv, generator=g) * 2
    gate[0, 5, 1] = -200.0  # a decay under float32's range: taken as 0
    beta = torch.rand(b, t, hv, generator=g)
    gate[1, -40:], beta[1, -40:] = 0.0, 0.0  # row 1's last 40 positions are padding
    state = torch.randn(b, hv, dk, dv, generator=g) * 0.3
    kept = state.clone()
    want, want_state = torch_recurrent_gated_delta_rule(*(u.double() for u in (q, k, v, gate, beta)),
                                                        initial_state=state.double(), output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    chunked = []
    real = gdn.chunk_gated_delta_rule
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", lambda *a, **kw: chunked.append(1) or real(*a, **kw))
    out, new_state = gated_delta_rule(q, k, v, gate, beta, state)
    assert not chunked and torch.equal(state, kept)
    scale = float(want.abs().max())
    assert float((out.double() - want).abs().max()) < 2e-5 * scale
    assert float((new_state.double() - want_state).abs().max()) < 2e-5 * float(want_state.abs().max())
    refuse = _build.entry("strata_pp_test_fail_allocs", (ctypes.c_long, ctypes.c_long))
    refuse(0, 1)
    try:
        out2, _ = gated_delta_rule(q, k, v, gate, beta, state)
    finally:
        refuse(0, 0)
    assert chunked == [1]
    assert float((out2.double() - want).abs().max()) < 2e-5 * scale
