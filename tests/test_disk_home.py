"""A disk home's reads: computed in the order they land, and each use counted once as what it was."""

import os
import threading

import pytest
import torch

from strata.tiers.store import DIRECT_MIN, DiskHome, ExpertFormat, FileReader, Part, read_slack

SIZES = (4096, 4096, 8192)  # gate, up, down bytes of one expert
N_EXPERTS = 6


def _home(path, capacity, readers=2) -> DiskHome:
    path.write_bytes(os.urandom(sum(SIZES) * N_EXPERTS))
    offsets, start = [], 0
    for n in SIZES:
        offsets.append(start)
        start += n * N_EXPERTS
    fmt = ExpertFormat(tuple(Part(None, (1, n), n, off) for n, off in zip(SIZES, offsets)))
    return DiskHome({0: fmt}, FileReader(path), capacity=capacity, readers=readers)


def test_arrival_yields_reads_as_they_land_and_uses_count_as_misses_hits_and_reads_ahead(tmp_path):
    home = _home(tmp_path / "m.gguf", capacity=2**20)  # room for all: nothing is evicted
    gate = threading.Event()
    read = home._read
    home._read = lambda layer, e: (gate.wait(5) if e == 1 else None, read(layer, e))[1]  # expert 1 lands last
    try:
        home.request(0, [4], ahead=True)  # a prediction
        home.request(0, [1, 2, 3, 4])  # the layer's own misses (4 already being read ahead)
        order = home.arrival(0, [1, 2, 3, 4])
        first = [next(order) for _ in range(3)]
        assert sorted(first) == [2, 3, 4]  # nothing waits for the slow read of expert 1
        gate.set()
        assert next(order) == 1
        for e in (1, 2, 3, 4):
            home.parts(0, e)
        assert (home.misses, home.hits, home.ahead_used, home.read_ahead) == (3, 0, 1, 1)
        for e in (1, 2):
            home.parts(0, e)  # cached now
        assert (home.misses, home.hits, home.ahead_used) == (3, 2, 1)
        assert home.used_bytes == 4 * sum(SIZES)  # each read once, when its first use needed it
        assert home.stats()["disk_reads"] == 4
    finally:
        gate.set()
        home.close()


def test_large_spans_are_read_straight_into_one_buffer_of_their_own(tmp_path):
    path = tmp_path / "big.bin"
    data = os.urandom(4 * DIRECT_MIN)
    path.write_bytes(data)
    reader = FileReader(path)
    try:
        spans = [(123, DIRECT_MIN), (4097, DIRECT_MIN + 5), (3 * DIRECT_MIN, 77)]
        got = reader.read_spans(spans)
        assert [bytes(t.numpy()) for t in got] == [data[o:o + n] for o, n in spans]
        storages = {t.untyped_storage().data_ptr() for t in got}
        assert len(storages) == 1  # one buffer, views into it
        if reader.direct:  # it holds at most the slack beyond the bytes asked for
            held = got[0].untyped_storage().nbytes()
            assert held - sum(n for _, n in spans) <= read_slack(2 * DIRECT_MIN)
        assert reader.bytes_read == sum(n for _, n in spans)
    finally:
        reader.close()


def test_evicted_buffers_are_read_into_again_only_once_nothing_views_them(tmp_path):
    n = 80
    path = tmp_path / "m.gguf"
    data = os.urandom(sum(SIZES) * n)
    path.write_bytes(data)
    offsets, start = [], 0
    for size in SIZES:
        offsets.append(start)
        start += size * n
    fmt = ExpertFormat(tuple(Part(None, (1, size), size, off) for size, off in zip(SIZES, offsets)))
    home = DiskHome({0: fmt}, FileReader(path), capacity=40 * sum(SIZES), readers=2)
    expect = lambda e: [data[off + e * size:off + (e + 1) * size] for size, off in zip(SIZES, offsets)]  # noqa: E731
    try:
        kept = home.parts(0, 0)  # a caller still computing from expert 0 after it is evicted
        for e in range(1, n):
            assert [bytes(t.numpy()) for t in home.parts(0, e)] == expect(e)
        assert [bytes(t.numpy()) for t in kept] == expect(0)  # its buffer was never read into again
        assert home.spare_reads > 0  # but evicted buffers nobody views were
        assert home.held <= home.capacity and home.stats()["reads_into_kept_buffers"] == home.spare_reads
        kept = None
        for e in range(n):  # a second pass reads everything again into kept buffers, correctly
            assert [bytes(t.numpy()) for t in home.parts(0, e)] == expect(e)
    finally:
        home.close()


def test_the_shared_expert_runs_while_the_routed_ones_are_read_and_gives_the_same_tokens(tmp_path):
    import strata
    from strata import synth
    from strata.models.layers import SharedExpert
    from strata.tiers import executor as ex

    path = synth.write(tmp_path / "next.gguf", like_name="qwen3-next-80b", layers=1, vocab=512, experts=16,
                       quant_name="Q4_0")
    ids = [3, 1, 4, 1, 5]
    ref = strata.load(path, cpu_threads=1)
    want_logits, want = ref.logits(ids), ref.generate(ids, 4, stop_at_eos=False)
    ref.close()
    engine = strata.load(path, cpu_threads=2, pin_experts="disk", ram_cache="25%")
    shared_ran, seen = threading.Event(), []
    run, shared_forward = ex.CpuLane._run, SharedExpert.forward

    def lane_run(self, *a):  # a worker finishing after the shared expert ran, if it runs beside it
        seen.append(shared_ran.wait(5))
        return run(self, *a)

    def shared(self, x):
        out = shared_forward(self, x)
        shared_ran.set()
        return out
    try:
        ex.CpuLane._run, SharedExpert.forward = lane_run, shared
        got = engine.generate(ids, 1, stop_at_eos=False)
        ex.CpuLane._run, SharedExpert.forward = run, shared_forward
        got = engine.generate(ids, 4, stop_at_eos=False)
        assert (engine.logits(ids) - want_logits).abs().max().item() < 1e-4
    finally:
        ex.CpuLane._run, SharedExpert.forward = run, shared_forward
        engine.close()
    assert got == want
    assert seen and all(seen)  # the shared expert was computed while the routed ones were under way


def test_a_decode_token_computes_its_disk_experts_by_one_call_each_with_the_same_products(tmp_path, monkeypatch):
    """A decode token's disk-homed experts go straight to strata_moe_token on their bytes (no route
    table, QTensor views or plans per expert), and every layer's output is bit-equal to the general path's."""
    import strata
    from strata import kernels, synth
    from strata.kernels import moe
    from strata.tiers import executor as ex

    if not kernels.available():
        import pytest
        pytest.skip("kernels unavailable")
    path = synth.write(tmp_path / "next.gguf", like_name="qwen3-next-80b", layers=1, vocab=512, experts=16,
                       quant_name="Q4_0")
    ids = [3, 1, 4, 1, 5]
    outputs, lane_calls = {"direct": {}, "general": {}}, []  # (experts, x) -> the worker's output
    mode = ["direct"]
    sum_in_order, grouped = ex._sum_in_order, moe.grouped_swiglu

    def record(products, x):
        out = sum_in_order(products, x)
        if x.shape[0] == 1:
            outputs[mode[0]][tuple(sorted(products)), x.numpy().tobytes()] = out.clone()
        return out

    def counted(x, *a, **k):
        if threading.current_thread().name.startswith("strata-cpu") and x.shape[0] == 1:
            lane_calls.append(mode[0])
        return grouped(x, *a, **k)

    monkeypatch.setattr(ex, "_sum_in_order", record)
    monkeypatch.setattr(moe, "grouped_swiglu", counted)
    engine = strata.load(path, cpu_threads=2, pin_experts="disk", ram_cache="25%")
    try:
        direct = engine.generate(ids, 4, stop_at_eos=False)
        mode[0] = "general"
        monkeypatch.setattr(ex.CpuLane, "_expert_kernels", lambda *a: None)
        general = engine.generate(ids, 4, stop_at_eos=False)
    finally:
        engine.close()
    assert direct == general
    assert outputs["direct"].keys() == outputs["general"].keys() and outputs["direct"]
    assert all(torch.equal(out, outputs["general"][key]) for key, out in outputs["direct"].items())
    assert "direct" not in lane_calls and "general" in lane_calls  # the direct path made no grouped call


def _disk_experts_lane(tmp_path, types, n_exp, hidden, ffn, workers):
    """Random stacked (gate, up, down) of `types` written to a file, its DiskHome and a CpuLane over it."""
    from strata.tiers.executor import CpuLane
    from strata.tiers.store import expert_format
    from test_kernels import random_qtensor

    shapes = [(n_exp, ffn, hidden), (n_exp, ffn, hidden), (n_exp, hidden, ffn)]
    stacked = tuple(random_qtensor(t, shape, seed=s) for s, (t, shape) in enumerate(zip(types, shapes)))
    path = tmp_path / "experts.bin"
    path.write_bytes(b"".join(q.raw.numpy().tobytes() for q in stacked))
    fmt = expert_format(stacked, [0, stacked[0].nbytes, stacked[0].nbytes + stacked[1].nbytes])
    home = DiskHome({0: fmt}, FileReader(path), capacity=1 << 22)
    return stacked, home, CpuLane(workers, {0: home}, {0: fmt})


def test_a_decode_tokens_landed_expert_goes_to_whichever_worker_is_free(tmp_path, monkeypatch):
    """Two workers, four experts: the one computing expert 1 is held until expert 3's product is
    done, which only the other worker can then compute (with a fixed half each, 1 and 3 were the
    same worker's, and it waited out the 5 s); the output is the fixed halves' sum, bit for bit."""
    from strata import kernels
    from strata.tiers.executor import CpuLane

    if not kernels.available():
        pytest.skip("kernels unavailable")
    _, home, lane = _disk_experts_lane(tmp_path, ("Q4_0",) * 3, 4, 256, 256, workers=2)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    ids, w = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0.125, 0.25, 0.375, 0.5]])
    third_done, held = threading.Event(), []
    call = kernels.moe_token_at

    def product(x, ptrs, spec, ws, threads, out):
        e = int(ws[0] * 8) - 1  # the weights name the experts
        if e == 1:
            held.append(third_done.wait(5))
        ok = call(x, ptrs, spec, ws, threads, out)
        if e == 3:
            third_done.set()
        return ok
    monkeypatch.setattr(kernels, "moe_token_at", product)
    try:
        futures = lane.submit(0, x, ids, w, [0, 1, 2, 3])
        y = futures[0].result() + futures[1].result()
        monkeypatch.setattr(kernels, "moe_token_at", call)
        monkeypatch.setattr(CpuLane, "_expert_kernels", lambda *a: None)  # the general path, fixed halves
        halves = [f.result() for f in lane.submit(0, x, ids, w, [0, 1, 2, 3])]
    finally:
        lane.close()
        home.close()
    assert held == [True]
    assert torch.equal(y, halves[0] + halves[1]) and y.abs().max().item() > 0


def test_a_decode_tokens_failing_sum_reaches_its_waiter(tmp_path, monkeypatch):
    """The last worker sums each half; a sum that raises is every waiter's error, not a future
    never set (the executor waits on it without a timeout)."""
    from strata import kernels
    from strata.tiers import executor as ex

    if not kernels.available():
        pytest.skip("kernels unavailable")
    _, home, lane = _disk_experts_lane(tmp_path, ("Q4_0",) * 3, 4, 256, 256, workers=2)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    ids, w = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0.125, 0.25, 0.375, 0.5]])

    def broken(products, x):
        raise MemoryError("sum failed")
    monkeypatch.setattr(ex, "_sum_in_order", broken)
    try:
        futures = lane.submit(0, x, ids, w, [0, 1, 2, 3])
        errors = [f.exception(timeout=30) for f in futures]
    finally:
        lane.close()
        home.close()
    assert len(errors) == 2 and all(isinstance(e, MemoryError) for e in errors)


def test_a_short_prompts_disk_experts_take_one_call_each_over_their_rows(tmp_path, monkeypatch):
    """In a short prompt most of a disk home's experts take 1-2 rows: each is one strata_moe_tokens
    call on its read's bytes over its rows (an expert with PROMPT_AMX_MIN_ROWS rows or more keeps
    the general path, prefill.c's product where it applies), and the layer's output agrees with the
    general path's and with float64 products of gguf-py's dequantized weights."""
    import numpy as np
    import pytest
    from gguf.quants import dequantize as gguf_dequantize

    from strata import kernels
    from strata.tiers.executor import CpuLane

    if not kernels.available():
        pytest.skip("kernels unavailable")
    n_exp, hidden, ffn, n = 6, 256, 512, 8
    types = ("IQ2_XS", "IQ2_XS", "Q4_0")  # the full-size flagship's expert layout
    stacked, home, lane = _disk_experts_lane(tmp_path, types, n_exp, hidden, ffn, workers=2)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, hidden, generator=g) * 0.05
    # expert 0: 7 rows; 1: 2 rows; 2: 1 row; 3: 6 rows (rows 0-6 pair 0 with 3, 4, 5 or 1)
    ids = torch.tensor([[0, 3], [0, 3], [0, 3], [0, 3], [0, 3], [0, 3], [0, 1], [2, 1]])
    w = torch.rand(n, 2, generator=g)
    used = sorted(set(ids.flatten().tolist()))
    calls = []
    at = kernels.moe_tokens_at
    monkeypatch.setattr(kernels, "moe_tokens_at", lambda xs, parts, spec, tokens, *a: calls.append(xs[tokens]) or
                        at(xs, parts, spec, tokens, *a))
    try:
        with kernels.prompt_batches():
            y = sum(f.result() for f in lane.submit(0, x, ids, w, used))
            monkeypatch.setattr(CpuLane, "_landing_products", lambda *a: None)
            general = sum(f.result() for f in lane.submit(0, x, ids, w, used))
    finally:
        lane.close()
        home.close()
    calls.sort(key=len)  # experts 1 and 2, one call each, over their own rows (ascending)
    assert len(calls) == 2 and torch.equal(calls[0], x[[7]]) and torch.equal(calls[1], x[[6, 7]])
    assert (y - general).abs().max().item() <= 1e-4 * general.abs().max().item()
    dense = [torch.from_numpy(gguf_dequantize(q.raw.numpy(), q.qtype)).double().reshape(q.shape) for q in stacked]
    ref = torch.zeros(n, hidden, dtype=torch.float64)
    for t in range(n):
        for e, wt in zip(ids[t].tolist(), w[t].tolist()):
            xt = x[t].double()
            h = torch.nn.functional.silu(dense[0][e] @ xt) * (dense[1][e] @ xt)
            ref[t] += wt * (dense[2][e] @ h)
    assert np.isfinite(ref.numpy()).all()
    assert (y.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()  # 8-bit x; a wrong sum is O(1) off


def test_a_cache_whose_arena_the_kernel_refuses_allocates_a_buffer_per_read(tmp_path, monkeypatch):
    from strata.tiers import store

    def refused(nbytes):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(store, "Arena", refused)
    home = _home(tmp_path / "m.gguf", capacity=2**20)  # large enough for an arena
    try:
        assert home.arena is None
        data = (tmp_path / "m.gguf").read_bytes()
        offsets = [0, SIZES[0] * N_EXPERTS, (SIZES[0] + SIZES[1]) * N_EXPERTS]
        got = {e: home.parts(0, e) for e in range(N_EXPERTS)}
        for e, parts in got.items():
            assert [bytes(t.numpy()) for t in parts] == [data[o + e * n:o + (e + 1) * n] for o, n in zip(offsets, SIZES)]
        storages = [{t.untyped_storage().data_ptr() for t in parts} for parts in got.values()]
        assert all(len(s) == 1 for s in storages)  # an expert's three parts view one buffer ...
        assert len(set().union(*storages)) == N_EXPERTS  # ... of its own: one per read
        assert all(parts[0].untyped_storage().nbytes() == sum(SIZES) for parts in got.values())
        assert home.spare_reads == 0
    finally:
        home.close()


@pytest.mark.parametrize("prompt", [True, False], ids=["short prompt", "decode token"])
def test_a_disk_expert_whose_one_call_declines_takes_the_general_path(tmp_path, monkeypatch, prompt):
    """strata_moe_tokens / strata_moe_token return 0 when their scratch cannot be allocated: that
    expert's product comes from the general path (a traceback before), and the layer's output is the
    general path's."""
    from contextlib import nullcontext

    from strata import kernels
    from strata.tiers.executor import CpuLane

    if not kernels.available():
        pytest.skip("kernels unavailable")
    n_exp, hidden, ffn = 4, 256, 256
    _, home, lane = _disk_experts_lane(tmp_path, ("Q4_0",) * 3, n_exp, hidden, ffn, workers=1)
    g = torch.Generator().manual_seed(5)
    # every expert 2 rows of a prompt (the one-call path), or one decode token's 2 experts
    ids = torch.tensor([[0, 1], [2, 1], [3, 0], [2, 3]] if prompt else [[2, 1]])
    x = torch.randn(ids.shape[0], hidden, generator=g) * 0.05
    w = torch.rand(*ids.shape, generator=g)
    experts = sorted(set(ids.reshape(-1).tolist()))
    calls = []
    monkeypatch.setattr(kernels, "moe_tokens_at" if prompt else "moe_token_at", lambda *a: calls.append(a) or False)
    try:
        with kernels.prompt_batches() if prompt else nullcontext():
            y = sum(f.result() for f in lane.submit(0, x, ids, w, experts))
            monkeypatch.setattr(CpuLane, "_landing_products", lambda *a: None)
            general = sum(f.result() for f in lane.submit(0, x, ids, w, experts))
    finally:
        lane.close()
        home.close()
    assert len(calls) == len(experts)
    assert torch.equal(y, general) and general.abs().max().item() > 0


def test_a_failed_read_gives_its_arena_buffer_back(tmp_path):
    """A read that fails (the file shrank, an I/O error) hands its arena buffer back, so the retry
    and later reads take it again instead of carving the arena away, read after failed read."""
    import gc

    import pytest

    home = _home(tmp_path / "m.gguf", capacity=2**20)
    try:
        assert home.arena is not None
        read_spans, failures = home.reader.read_spans, []

        def failing(spans, into=None):
            if len(failures) < 3:
                failures.append(1)
                raise OSError(5, "Input/output error")
            return read_spans(spans, into)
        home.reader.read_spans = failing
        for _ in range(3):
            with pytest.raises(OSError):
                home.parts(0, 1)
        gc.collect()  # (each failed read's traceback holds its buffer in a reference cycle)
        carved = home.arena._carved
        data = (tmp_path / "m.gguf").read_bytes()
        got = home.parts(0, 1)
        offsets = [0, SIZES[0] * N_EXPERTS, (SIZES[0] + SIZES[1]) * N_EXPERTS]
        assert [bytes(t.numpy()) for t in got] == [data[o + n:o + 2 * n] for o, n in zip(offsets, SIZES)]
        assert home.arena._carved == carved and home.arena.reused == 1  # a failed read's buffer, taken again
    finally:
        home.close()


def test_busy_time_counts_overlapping_reads_once(tmp_path):
    """`busy_s` is the time at least one read was in flight (the bandwidth a run's own reads got is
    device bytes over it): two reads in flight together count their overlap once."""
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(4 * DIRECT_MIN))
    reader = FileReader(path)
    now = [0.0]
    reader._clock = lambda: now[0]
    started, release = [threading.Semaphore(0) for _ in range(2)]
    inner = reader._direct_into if reader.direct else reader._read_chunk

    def held(*args):
        started.release()
        release.acquire()
        return inner(*args)

    if reader.direct:
        reader._direct_into = held
    else:
        reader._read_chunk = held
    try:
        spans = [[(0, DIRECT_MIN)], [(2 * DIRECT_MIN, DIRECT_MIN)]]
        threads = [threading.Thread(target=reader.read_spans, args=(s,)) for s in spans]
        threads[0].start()
        started.acquire()  # read 0 in flight from t=0
        now[0] = 1.0
        threads[1].start()
        started.acquire()  # read 1 in flight from t=1
        now[0] = 3.0
        assert reader.busy_s == 3.0  # still in flight: counted up to now
        release.release()
        release.release()
        for t in threads:
            t.join()
        assert reader.busy_s == 3.0  # the union, 0..3, where the reads' own times sum to 5
        now[0] = 10.0
        release.release()
        reader.read_spans([(0, DIRECT_MIN)])  # nothing in flight from 3 to 10: not counted
        assert reader.busy_s == 3.0
        assert reader.device_bytes >= 3 * DIRECT_MIN
    finally:
        reader.close()


def test_while_its_arena_is_populated_the_cache_holds_what_is_populated(tmp_path, monkeypatch):
    """Reads reuse evicted experts' buffers rather than fault fresh pages in (a virtual machine backs
    those at 2.7 s a GiB, inside the readers' reads) until the populating thread is done; then the
    cache grows to its capacity, and every read returns the file's bytes throughout."""
    from strata.tiers import arena as arena_module
    from test_arena import _SlowPopulate

    n, size = 80, sum(SIZES)
    slow = _SlowPopulate(first=1)
    monkeypatch.setattr(arena_module, "_madvise", slow)
    monkeypatch.setattr(arena_module, "POPULATE_CHUNK", 16 * size)  # 16 experts' buffers
    path = tmp_path / "m.gguf"
    data = os.urandom(size * n)
    path.write_bytes(data)
    offsets = [0, SIZES[0] * n, (SIZES[0] + SIZES[1]) * n]
    fmt = ExpertFormat(tuple(Part(None, (1, s), s, off) for s, off in zip(SIZES, offsets)))
    home = DiskHome({0: fmt}, FileReader(path), capacity=40 * size, readers=2)
    expect = lambda e: [data[o + e * s:o + (e + 1) * s] for o, s in zip(offsets, SIZES)]  # noqa: E731
    try:
        assert home.arena is not None
        for e in range(30):
            assert [bytes(t.numpy()) for t in home.parts(0, e)] == expect(e)
        ready = home.arena.ready
        assert ready == 16 * size  # one chunk populated, the thread held up
        assert home.held <= ready - home._spare_room + size  # the cache stayed within it ...
        assert home.arena._carved <= ready  # ... and no read went past the populated front
        slow.go.set()
        home.arena._thread.join(10)
        for e in range(30, n):
            assert [bytes(t.numpy()) for t in home.parts(0, e)] == expect(e)
        assert home.held > ready  # populated: the cache fills its capacity
        assert home.held <= home.capacity
    finally:
        slow.go.set()
        home.close()


def test_a_prompt_pauses_the_cache_populating_and_its_experts_land_one_call_each(tmp_path, monkeypatch):
    """A prompt's forward holds the RAM cache's populating thread and a decode step lets it go on; a
    prompt of up to FAST_BATCH_MAX rows computes its disk experts as they land, each over its own rows
    (not the general path's one call over all of them), with the resident run's greedy tokens."""
    import strata
    from strata import kernels, synth
    from strata.tiers.executor import CpuLane

    if not kernels.available():
        pytest.skip("kernels unavailable")
    path = synth.write(tmp_path / "next.gguf", like_name="qwen3-next-80b", layers=1, vocab=512, experts=64,
                       quant_name="Q4_0")  # a cache of 4 x SPARES experts or more has an arena
    ids = [(7 * i + 3) % 512 for i in range(24)]  # more rows than the 8 that took the landing path before
    ref = strata.load(path, cpu_threads=1)
    want = ref.generate(ids, 4, stop_at_eos=False)
    ref.close()
    engine = strata.load(path, cpu_threads=2, pin_experts="disk", ram_cache="90%")
    phases, landed = [], []
    wide = DiskHome.wide_forward
    monkeypatch.setattr(DiskHome, "wide_forward", lambda self, on: phases.append(on) or wide(self, on))
    products = CpuLane._landing_products
    monkeypatch.setattr(CpuLane, "_landing_products", lambda self, *a: landed.append(a[2].shape[0]) or products(self, *a))
    try:
        home = next(h for h in engine.tiers.homes.values() if h.kind == "disk")
        assert home.arena is not None
        got = engine.generate(ids, 4, stop_at_eos=False)
    finally:
        engine.close()
    assert phases[0] is True and phases[-1] is False  # the prompt paused it, decode let it go on
    assert landed[0] == 24  # the prompt's rows, by the landing path
    assert got == want


def test_a_layers_own_request_drops_the_reads_ahead_for_it_that_it_does_not_ask_for(tmp_path):
    """A prediction's reads still queued when its layer routes elsewhere are wrong: they are dropped
    before they take the disk; one already started runs on, and one the layer asks for is moved up."""
    home = _home(tmp_path / "m.gguf", capacity=2**20, readers=1)
    gate, started = threading.Event(), threading.Event()
    read = home._read
    home._read = lambda layer, e: (started.set(), gate.wait(5), read(layer, e))[2]
    try:
        home.request(0, [1, 2, 3], ahead=True)  # the one reader takes expert 1 and waits
        assert started.wait(5)
        home.request(0, [2, 4])  # the layer routes to 2 and 4: 3 was a wrong prediction
        assert home.cancelled == 1 and (0, 3) not in home.inflight and home.read_ahead == 2
        gate.set()
        assert sorted(home.arrival(0, [2, 4])) == [2, 4]
        assert [bytes(t.numpy()) for t in home.parts(0, 2)] == [bytes(t.numpy()) for t in read(0, 2)]
        home.parts(0, 4)
        assert home.stats()["disk_reads"] == 3 and home.stats()["read_ahead_cancelled"] == 1  # 1, 2, 4; never 3
    finally:
        gate.set()
        home.close()
