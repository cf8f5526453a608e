"""A decode step's small torch products run on one thread (kernels/threads.py), so a descheduled
OpenMP thread on shared cores cannot stall them; large ones keep torch's team."""

import pytest
import torch
import torch.nn.functional as F

import strata
from strata.kernels.threads import SMALL_WORK, kernel_threads, one_thread_if_small, torch_team_for_large_only
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


def test_prompt_scope_runs_torch_on_one_thread_and_gives_large_work_the_team(two_threads):
    """Inside a prompt's scope torch has one thread, the kernels' pool keeps the team, large work
    gets the team back for its block, and leaving (also by an exception) restores the count."""
    with torch_team_for_large_only():
        assert torch.get_num_threads() == 1 and kernel_threads() == 2
        with one_thread_if_small(SMALL_WORK + 1):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with one_thread_if_small(10):
            assert torch.get_num_threads() == 1
        with torch_team_for_large_only():  # nested: nothing more to lower
            assert torch.get_num_threads() == 1 and kernel_threads() == 2
        assert kernel_threads() == 2
    assert torch.get_num_threads() == 2 and kernel_threads() == 2
    with pytest.raises(RuntimeError):
        with torch_team_for_large_only():
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2
    with one_thread_if_small(SMALL_WORK + 1):  # outside a scope large work changes nothing
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


@pytest.fixture
def parallel_8bit(request):
    """An 8-bit activation mode, and every product big enough to be shared out (tiny test matrices)."""
    from strata import kernels
    from strata.kernels import _build

    lib = _build.load()
    if lib is None or not kernels.ggml_types():
        pytest.skip("needs the kernels and ggml's 8-bit dot products")
    before = kernels.activations()
    kernels.set_activations(request.param)
    lib.strata_set_min_parallel(0)
    yield lib
    lib.strata_set_min_parallel(256 * 1024)
    kernels.set_activations(before)


@pytest.mark.parametrize("parallel_8bit", ["q8x2", "q8", "q8c"], indirect=True)
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XS", "IQ2_XS", "Q2_K"), ("Q4_1", "Q8_0", "Q5_0")])
def test_decode_token_experts_are_two_parallel_regions_bit_equal(types, parallel_8bit):
    """A decode token's k experts: every gate and up in one pool job over x quantized once, then
    every down in one (it was 3k jobs, each quantizing x again); the same sums as expert by expert."""
    from strata import kernels
    from test_kernels import random_qtensor

    lib = parallel_8bit
    gate, up = (random_qtensor(types[i], (8, 256, 512), seed=10 + i) for i in (0, 1))
    down = random_qtensor(types[2], (8, 512, 256), seed=12)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1))
    ids, weights = torch.tensor([[5, 0, 3, 7]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]])

    def expert(e):
        return gate[e], up[e], down[e]

    def expert_by_expert(x, threads):
        out = torch.zeros_like(x)
        for e, w in zip(ids[0].tolist(), weights[0].tolist()):
            out.add_(kernels.expert_forward(x, *expert(e), threads=threads), alpha=w)
        return out

    for threads in (1, 2):
        jobs = lib.strata_pool_jobs()
        one_call = kernels.run_experts_fast(x, ids, weights, expert, threads=threads)
        assert lib.strata_pool_jobs() - jobs == 2
        assert torch.equal(one_call, expert_by_expert(x, threads))
    bad = x.clone()
    bad[0, 3] = float("nan")  # declined by the 8-bit path: each product as it would run alone
    torch.testing.assert_close(kernels.run_experts_fast(bad, ids, weights, expert, threads=2),
                               expert_by_expert(bad, 2), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("parallel_8bit", ["q8x2"], indirect=True)
@pytest.mark.parametrize("batch", [1, 3])
def test_projection_group_is_one_parallel_region_bit_equal(batch, parallel_8bit):
    from strata.models.linear import Linear, linear_group
    from test_kernels import random_qtensor

    lib = parallel_8bit
    g = torch.Generator().manual_seed(3)
    lins = (Linear(random_qtensor("Q4_K", (96, 512), seed=1), torch.randn(96, generator=g)),
            Linear(random_qtensor("Q6_K", (32, 512), seed=2)),
            Linear(random_qtensor("Q8_0", (32, 512), seed=3), torch.randn(32, generator=g)))
    x = torch.randn(batch, 1, 512, generator=g)
    jobs = lib.strata_pool_jobs()
    grouped = linear_group(x, lins)
    assert lib.strata_pool_jobs() - jobs == 1
    for a, lin in zip(grouped, lins):
        assert torch.equal(a, lin(x))


def test_resident_decode_experts_take_no_per_expert_views(monkeypatch):
    """A decode token over resident stacked experts: the one C call gets each expert's bytes from the
    stacked plan (no k x 3 QTensor views, each planned anew); the same result as by views."""
    from strata import kernels
    from strata.formats.weights import QTensor
    from strata.kernels.grouped import route_table
    from test_kernels import random_qtensor

    if not kernels.available():
        pytest.skip("kernels unavailable")
    gate, up = (random_qtensor("Q4_K", (8, 256, 512), seed=10 + i) for i in (0, 1))
    down = random_qtensor("Q6_K", (8, 512, 256), seed=12)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(1))
    table = route_table(torch.tensor([[5, 0, 3]]), torch.tensor([[0.5, 0.3, 0.2]]))
    by_views = kernels.grouped_swiglu(x, table, lambda e: (gate[e], up[e], down[e]))
    kernels.grouped_swiglu(x, table, (gate, up, down))  # the stacked plans: expert 0's, made once

    def no_views(*a):
        raise AssertionError("a per-expert view on the decode path")

    monkeypatch.setattr(QTensor, "__getitem__", no_views)
    monkeypatch.setattr(kernels, "_moe_token", no_views)
    assert torch.equal(kernels.grouped_swiglu(x, table, (gate, up, down)), by_views)


def test_cpu_lane_workers_run_torch_on_one_thread(two_threads):
    """The tiers' CPU workers are the parallelism: each runs torch's operators on one thread (a small
    operator opening torch's team from a worker waited on a peer busy with the other worker), and
    the caller's thread keeps its count."""
    from strata.tiers.executor import CpuLane

    lane = CpuLane(2, {}, {})
    try:
        seen = {lane.pool.submit(torch.get_num_threads).result() for _ in range(4)}
    finally:
        lane.close()
    assert seen == {1}
    assert torch.get_num_threads() == 2
    import threading

    fresh = []  # what a new thread's torch starts with
    plain = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    plain.start()
    plain.join()
    lane = CpuLane(1, {}, {})  # one worker: torch's team is its only parallelism, left as it starts
    try:
        assert lane.pool.submit(torch.get_num_threads).result() == fresh[0]
    finally:
        lane.close()


def test_importing_strata_makes_torch_team_wait_passively():
    """Before torch is imported, `import strata` asks libgomp for passive waits, unless the user chose."""
    import os
    import subprocess
    import sys

    code = "import os, strata; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = lambda c, e: subprocess.run([sys.executable, "-c", c], env=e, capture_output=True, text=True,  # noqa: E731
                                      check=True).stdout.strip()
    assert run(code, env) == "PASSIVE"
    assert run(code, {**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    assert run("import torch; " + code, env) == "None"  # libgomp has read the environment already


def test_load_runs_without_the_cyclic_collector_and_restores_it(tmp_path, monkeypatch):
    """Building a model makes many long-lived objects: no collection runs while it loads, and the
    collector is on again after (and stays off for a caller that had turned it off)."""
    import gc

    from strata.runtime import engine as engine_module

    seen = []
    real = engine_module.load

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(engine_module, "load", spy)
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    strata.load(path, draft="off").close()
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        strata.load(path, draft="off").close()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_every_tile_of_a_pool_job_runs_once_whatever_the_threads():
    """The kernel pool's tile claims (each thread's own contiguous share from its front, the others'
    stolen from their back): every tile of every job runs exactly once, with more threads than
    cores (helpers descheduled while holding a share), fewer tiles than threads, and one tile."""
    import ctypes
    from collections import Counter

    from strata.kernels import _build

    lib = _build.load()
    if lib is None:
        pytest.skip(f"kernels unavailable: {_build.error()}")
    tile_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)
    run = lib.strata_pool_run
    run.argtypes, run.restype = [tile_fn, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int], None
    for nth in (2, 3, 8):
        for n in (1, 2, 5, 64, 777):
            seen = Counter()
            fn = tile_fn(lambda _args, t: seen.update((t,)))  # (ctypes takes the GIL for each call)
            before = lib.strata_pool_jobs()
            run(fn, None, n, nth)
            assert lib.strata_pool_jobs() == before + 1
            assert seen == Counter(range(n)), (nth, n)


def test_pool_timeline_accounts_each_decode_token(tmp_path, capsys, monkeypatch, two_threads):
    """bench/decode_profile.py's timeline: every pool job of a token lies inside it, the stack's
    layer marks come in order, and the summary and one token's events are printed."""
    import ctypes
    import importlib.util
    from pathlib import Path

    from strata.kernels import _build

    if _build.load() is None:
        pytest.skip(f"kernels unavailable: {_build.error()}")
    spec = importlib.util.spec_from_file_location(
        "decode_profile", Path(__file__).resolve().parents[1] / "bench" / "decode_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    engine = strata.load(write_q8_llama(tmp_path / "tiny.gguf"), cpu_threads=2, draft="off")
    profile.print_timeline(engine, [1, 2, 3], steps=3)
    out = capsys.readouterr().out
    assert "timeline of 3 decode tokens" in out and "calling thread CPU outside pool jobs" in out
    lines = out.splitlines()
    events = lines[lines.index(next(l for l in lines if "one token's events" in l)) + 2:]
    marks = [l.split(">")[1].split()[:2] for l in events if ">" in l]
    layers = len(engine.model.blocks)
    assert [m for m in marks if m[0] in ("attention", "ffn")] == [
        [kind, "half"] for _ in range(layers) for kind in ("attention", "ffn")]
    assert events[-1].split()[1:3] == ["token", "end"]
    jobs = int(next(l for l in lines if "pool jobs" in l).split(" pool jobs")[0].split()[-1])
    assert jobs > 0 and sum(1 for l in events if ">" not in l) - 1 == jobs  # (the middle token's, printed)
    # a reader sized for another event layout gets nothing, not an overrun buffer
    buf = (ctypes.c_int64 * (2 * profile.EV))()
    read = _build.load().strata_pool_trace_read
    assert read(buf, 1, profile.EV - 1) == -1 and read(buf, 1, profile.EV + 1) == -1
    assert read(buf, 1, profile.EV) == 1
    monkeypatch.setattr(profile, "memory_bandwidth", lambda: 10.0)  # (a 1 GiB copy, not what is tested)
    profile.print_profile(engine, [1, 2, 3], 2)  # bench_vs_llamacpp --profile's other views, over the one-call token
    profile.replay_products(engine, [1, 2, 3], repeats=2)
    out = capsys.readouterr().out
    assert "stack of 2 layers" in out and "replayed: 1 product calls alone" in out


def write_q8_llama(path):
    """The tiny llama with its matrices in Q8_0 (so decode takes the kernels and the one-call stack)."""
    import gguf

    from strata.formats import llama
    from strata.gguf.writer import write_gguf
    from tiny import byte_tokenizer_metadata, llama_config, llama_tensors

    c = llama_config(ffn_size=64)  # (every matrix's rows a whole number of 32-value blocks)
    q8, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    tensors = [(n, t, q8 if t.dim() >= 2 else f32) for n, t in llama_tensors(c).items()]
    return write_gguf(path, "llama", {**llama.gguf_metadata(c), **byte_tokenizer_metadata()}, tensors)
