"""Where one decode step of a loaded Strata engine goes, and how close it is to memory bandwidth.

Used by bench_vs_llamacpp.py --profile. Views of the same decode steps:
  parts    the model's pieces (attention, router, experts, output head, ...) by wall time,
  kernels  each quantized matrix product, by ggml type and shape, with its GB/s,
  ops      torch's own operators by self CPU time (what is left between the kernels),
then the bytes of weights one token reads against a large tensor copy's bandwidth, and the
quantized products (and one-call layer halves) of one decode step replayed alone (`replay_products`), by CPU time, so the
time outside them (Python, torch operators, attention) is the step's CPU time minus theirs, and the
kernel pool's job timeline (`print_timeline`): per token, the calling thread's and the helpers' share
of each job, the waits, and the serial time between jobs.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from strata import kernels
from strata.kernels import decode_ops, decode_stack
from strata.formats.weights import QTensor
from strata.models.layers import Experts
from strata.models.linear import Embedding, Linear
from strata.models.transformer import MoE


def memory_bandwidth(mb: int = 512) -> float:
    """GB/s of a big tensor copy, counting bytes read plus bytes written (best of 10)."""
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best / 1e9


def _label_modules(model) -> list:
    """Wrap the forwards of the model's parts in profiler labels; returns the undo list."""
    undo = []

    def wrap(module, label):
        inner = module.forward

        def forward(*args, **kwargs):
            with record_function(label):
                return inner(*args, **kwargs)

        module.forward = forward
        undo.append(module)

    for block in model.blocks:
        wrap(block, "part: blocks (all of each layer)")
        wrap(block.attn_norm, "part: attn_norm")
        wrap(block.attn, f"part: {type(block.attn).__name__.lower()}")
        wrap(block.ffn_norm, "part: ffn_norm")
        ffn = block.ffn
        if isinstance(ffn, MoE):
            wrap(ffn, "part: moe (router, top-k, shared, scatter)")
            if isinstance(ffn.experts, Experts):
                wrap(ffn.experts, "part: moe experts")
        else:
            wrap(ffn, "part: dense ffn")
    wrap(model.output_norm, "part: output_norm")
    return undo


KERNEL_BYTES: dict[str, int] = {}  # label -> weight bytes one call reads


def _label_kernels():
    """Label every compiled quantized product by type, shape and batch, each one-call MoE token
    (strata_moe_token) by its experts' types and each projection group (strata_qmm_group) by its
    weights; returns the originals."""
    originals = kernels.try_qmatmul, kernels._moe_token

    def labelled_stacked(x, table, stacked, threads, out):
        types = "/".join(q.qtype.name for q in stacked)
        k = table.expert.numel()
        label = f"qmm moe-token {types} k{k}x3x{stacked[0].shape[1]}x{stacked[0].shape[2]}"
        KERNEL_BYTES[label] = sum(q.nbytes // q.shape[0] for q in stacked) * k
        with record_function(label):
            return stacked_original(x, table, stacked, threads, out)

    def labelled(x, w, threads=None):
        rows, cols = w.shape
        label = f"qmm {w.qtype.name} {rows}x{cols} b{x.numel() // cols}"
        KERNEL_BYTES[label] = w.nbytes
        with record_function(label):
            return originals[0](x, w, threads)

    def labelled_moe(x, parts, w, threads, out):
        types = "/".join(q.qtype.name for q in parts[0])
        label = f"qmm moe-token {types} k{len(parts)}x3x{parts[0][0].shape[0]}x{parts[0][0].shape[1]}"
        KERNEL_BYTES[label] = sum(q.nbytes for p in parts for q in p)
        with record_function(label):
            return originals[1](x, parts, w, threads, out)

    def labelled_group(x, ws, biases):
        label = "qmm group " + "+".join(f"{w.qtype.name} {w.shape[0]}x{w.shape[1]}" for w in ws) + f" b{x.numel() // x.shape[-1]}"
        KERNEL_BYTES[label] = sum(w.nbytes for w in ws)
        with record_function(label):
            return originals[2](x, ws, biases)

    originals = (*originals, decode_ops.try_qmatmul_group)
    stacked_original = kernels._moe_token_stacked
    kernels.try_qmatmul, kernels._moe_token, decode_ops.try_qmatmul_group = labelled, labelled_moe, labelled_group
    kernels._moe_token_stacked = labelled_stacked
    _label_halves()
    return (*originals, stacked_original)


HALVES = ("try_attention_block", "try_ffn_block", "try_moe_block", "try_gdn_block")
_half_originals: dict[str, object] = {}


def _half_label(name: str, args) -> tuple[str, int]:
    """A C layer half's label (its weights' types; its norm, rope, attention or routing included)
    and the weight bytes one call reads."""
    if name == "try_attention_block":
        lins = [args[2].wq, args[2].wk, args[2].wv, args[2].wo]
        return "half attention " + "+".join(f"{lin.weight.qtype.name}" for lin in lins), sum(lin.nbytes for lin in lins)
    if name == "try_gdn_block":
        lins = [args[2].wqkv, args[2].wz, args[2].wb, args[2].wa, args[2].wo]
        return "half deltanet " + "+".join(f"{lin.weight.qtype.name}" for lin in lins), sum(lin.nbytes for lin in lins)
    if name == "try_ffn_block":
        lins = [args[2].gate, args[2].up, args[2].down]
        return "half dense ffn " + "+".join(f"{lin.weight.qtype.name}" for lin in lins), sum(lin.nbytes for lin in lins)
    moe, k = args[2], args[3]
    b = moe.experts.backend
    n = sum(q.nbytes // q.shape[0] for q in (b.gate, b.up, b.down)) * k + moe.router.nbytes
    if moe.shared is not None:
        n += sum(lin.nbytes for lin in (moe.shared.ffn.gate, moe.shared.ffn.up, moe.shared.ffn.down))
    return f"half moe k{k} {b.gate.qtype.name}/{b.up.qtype.name}/{b.down.qtype.name}" + (" +shared" if moe.shared else ""), n


def _stack_label(stack) -> tuple[str, int]:
    """A one-call layer stack's label (its weights' types) and the weight bytes one call reads:
    each 2-D weight it was built from (the layers' Linears, the routers) in full, and k experts of
    each MoE layer's stacks."""
    kinds, seen, n = set(), set(), 0
    for obj in stack.sources:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, QTensor):
            kinds.add(obj.qtype.name)
            n += obj.nbytes if len(obj.shape) == 2 else 0
        elif isinstance(obj, torch.Tensor) and obj.dim() == 2:
            n += obj.nbytes
    n += sum(sum(lay.exp_stride) * lay.k for lay in stack.layers if lay.moe)
    return f"stack of {len(stack.layers)} layers " + "/".join(sorted(kinds)), n


def _label_halves():
    """Label the one-call layer halves (decode_ops.try_*_block) and layer stacks
    (decode_stack.try_decode) as kernels; `_unlabel_halves` undoes it."""
    inner_stack = _half_originals["try_decode"] = decode_stack.try_decode

    def labelled_stack(stack, *rest):
        if stack.layers is None:
            return inner_stack(stack, *rest)
        label, nbytes = _stack_label(stack)
        KERNEL_BYTES["qmm " + label] = nbytes
        with record_function("part: blocks (all of each layer)"), record_function("qmm " + label):
            return inner_stack(stack, *rest)

    decode_stack.try_decode = labelled_stack
    for name in HALVES:
        inner = _half_originals[name] = getattr(decode_ops, name)

        def labelled(*args, _inner=inner, _name=name):
            label, nbytes = _half_label(_name, args)
            KERNEL_BYTES["qmm " + label] = nbytes
            with record_function("qmm " + label):
                return _inner(*args)

        setattr(decode_ops, name, labelled)


def _unlabel_halves():
    for name, fn in _half_originals.items():
        setattr(decode_stack if name == "try_decode" else decode_ops, name, fn)


def bytes_per_token(model, k: int) -> dict[str, int]:
    """Bytes of weights one decode token reads, by kind: every dense weight once, one embedding
    row, and the routed experts (k per MoE layer, each expert's three matrices)."""
    out: dict[str, int] = defaultdict(int)
    seen: set[int] = set()

    def count(kind, n, key):
        if key not in seen:
            seen.add(key)
            out[kind] += n

    for m in model.modules():
        if isinstance(m, Experts):
            b = m.backend
            per_expert = b.gate[0].nbytes + b.up[0].nbytes + b.down[0].nbytes
            out["experts (routed)"] += per_expert * k
            continue
        for value in vars(m).values():
            if isinstance(value, Linear):
                kind = "dense, quantized" if value.quantized else "dense, float"
                count(kind, value.nbytes, id(value.weight))
            elif isinstance(value, Embedding):
                count("embedding row", value.weight.nbytes // value.shape[0], id(value))
            elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.is_floating_point():
                count("dense, float", value.nbytes, id(value))
    return dict(out)


def print_profile(engine, prompt: list[int], steps: int) -> None:
    model = engine.model
    cache = model.new_cache(1)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), cache, last_only=True)[:, 0]
        token = logits.argmax(-1)
        walls = []
        for _ in range(3):  # warm
            token = model(token[:, None], cache, last_only=True)[:, 0].argmax(-1)
        undo = _label_modules(model)
        original = _label_kernels()
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    t = time.perf_counter()
                    with record_function("step"):
                        token = model(token[:, None], cache, last_only=True)[:, 0].argmax(-1)
                    walls.append(time.perf_counter() - t)
        finally:
            kernels.try_qmatmul, kernels._moe_token, decode_ops.try_qmatmul_group, kernels._moe_token_stacked = original
            _unlabel_halves()
            for m in undo:
                del m.forward
    step_ms = statistics.median(walls) * 1e3
    events = prof.key_averages()
    per = {e.key: e for e in events}
    total_ms = per["step"].cpu_time_total / 1e3 / steps

    print(f"\n  decode step: {step_ms:.2f} ms wall (median of {steps}), {total_ms:.2f} ms under the profiler")
    print(f"  {'part':<44} {'ms/token':>8} {'share':>6}")
    for e in sorted((e for e in events if e.key.startswith("part: ")), key=lambda e: -e.cpu_time_total):
        ms = e.cpu_time_total / 1e3 / steps
        print(f"  {e.key[6:]:<44} {ms:8.2f} {100 * ms / total_ms:5.1f}%")
    # the blocks hold every other part but the final norm (a decode token's layer halves in C run no
    # module below the block)
    parts = sum(e.cpu_time_total for e in events if e.key in ("part: blocks (all of each layer)", "part: output_norm"))
    rest = total_ms - parts / 1e3 / steps
    print(f"  {'(the rest: embedding, head, loop, argmax)':<44} {rest:8.2f} {100 * rest / total_ms:5.1f}%")

    print(f"\n  {'kernel':<40} {'calls':>5} {'ms/token':>8} {'GB/s':>6}")
    qmm = sorted((e for e in events if e.key.startswith("qmm ")), key=lambda e: -e.cpu_time_total)
    kernel_ms = 0.0
    for e in qmm:
        nbytes = KERNEL_BYTES[e.key]
        ms = e.cpu_time_total / 1e3 / steps
        kernel_ms += ms
        gbs = nbytes * e.count / (e.cpu_time_total / 1e6) / 1e9
        print(f"  {e.key[4:]:<40} {e.count // steps:5d} {ms:8.3f} {gbs:6.1f}")
    print(f"  {'all quantized products':<40} {'':>5} {kernel_ms:8.2f} ({100 * kernel_ms / total_ms:.0f}% of the step; "
          "a 'half' is a layer half in one C call, its norms, rope, attention and routing included)")

    print(f"\n  {'torch operator (self CPU)':<44} {'calls':>5} {'ms/token':>8}")
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    for e in ops[:12]:
        print(f"  {e.key:<44} {e.count // steps:5d} {e.self_cpu_time_total / 1e3 / steps:8.3f}")
    torch_ms = sum(e.self_cpu_time_total for e in ops) / 1e3 / steps
    n_ops = sum(e.count for e in ops) // steps
    print(f"  {'all torch operators':<44} {n_ops:5d} {torch_ms:8.2f}")
    python_ms = total_ms - kernel_ms - torch_ms
    print(f"  per token: {n_ops} torch operator calls, {len(qmm) and sum(e.count for e in qmm) // steps} kernel "
          f"calls; Python and the rest outside kernels and torch operators {python_ms:.2f} ms "
          f"({100 * python_ms / total_ms:.0f}% of the step)")

    read = bytes_per_token(model, getattr(model.config, "n_experts_used", 0))
    bw = memory_bandwidth()
    total = sum(read.values())
    print("\n  weights read per decode token (KV cache not counted; short context):")
    for kind, n in sorted(read.items(), key=lambda kv: -kv[1]):
        print(f"    {kind:<22} {n / 2**20:8.2f} MiB")
    floor_ms = total / bw / 1e6
    print(f"    {'total':<22} {total / 2**20:8.2f} MiB; memory bandwidth {bw:.1f} GB/s (copy, read+write) "
          f"-> floor {floor_ms:.2f} ms/token ({1e3 / floor_ms:.0f} tok/s); measured {step_ms:.2f} ms "
          f"= {100 * floor_ms / step_ms:.0f}% of bandwidth")


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by kind: the calling thread, the
    kernels' pool helpers (named strata-pool), and the others (torch's OpenMP team, I/O)."""
    out: dict[str, float] = defaultdict(float)
    me, tick = threading.get_native_id(), os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                name, fields = f.read().rsplit(")", 1)
        except OSError:  # the thread ended meanwhile
            continue
        kind = "calling" if int(tid) == me else "pool helpers" if name.endswith("(strata-pool") else "other"
        out[kind] += (int(fields.split()[11]) + int(fields.split()[12])) / tick
    return out


def replay_products(engine, prompt: list[int], repeats: int = 8) -> None:
    """CPU ms per token of one decode step's quantized products called alone (recorded from a real
    step, then replayed back to back), against the whole step's CPU ms: the rest is everything
    outside the kernels. CPU time, not wall, so a shared machine's descheduling does not count."""
    model = engine.model
    calls = []
    originals = kernels.try_qmatmul, kernels._moe_token, decode_ops.try_qmatmul_group, kernels._moe_token_stacked

    def rec_s(x, table, stacked, threads, out):
        calls.append((lambda *a: originals[3](*a, torch.zeros_like(a[0])), (x.clone(), table, stacked, threads)))
        return originals[3](x, table, stacked, threads, out)

    halves = {name: getattr(decode_ops, name) for name in HALVES}

    def rec_half(name):
        def rec(x, *rest):
            calls.append((halves[name], (x.clone(), *rest)))
            return halves[name](x, *rest)
        return rec

    stack_original = decode_stack.try_decode

    def rec_stack(stack, x, *rest):  # replayed at the same position: the same keys and values rewritten
        calls.append((stack_original, (stack, None if x is None else x.clone(), *rest)))  # (None: the token path)
        return stack_original(stack, x, *rest)

    def rec_q(x, w, threads=None):
        calls.append((originals[0], (x.clone(), w, threads)))
        return originals[0](x, w, threads)

    def rec_m(x, parts, w, threads, out):
        calls.append((lambda *a: originals[1](*a[:4], torch.zeros_like(a[0])), (x.clone(), parts, w, threads)))
        return originals[1](x, parts, w, threads, out)

    def rec_g(x, ws, biases):
        calls.append((originals[2], (x.clone(), ws, biases)))
        return originals[2](x, ws, biases)

    cache = model.new_cache(1)
    with torch.inference_mode():
        token = model(torch.tensor([prompt]), cache, last_only=True)[:, 0].argmax(-1)
        token = model(token[:, None], cache, last_only=True)[:, 0].argmax(-1)
        kernels.try_qmatmul, kernels._moe_token, decode_ops.try_qmatmul_group, kernels._moe_token_stacked = (
            rec_q, rec_m, rec_g, rec_s)
        for name in HALVES:
            setattr(decode_ops, name, rec_half(name))
        decode_stack.try_decode = rec_stack
        try:
            token = model(token[:, None], cache, last_only=True)[:, 0].argmax(-1)
        finally:
            kernels.try_qmatmul, kernels._moe_token, decode_ops.try_qmatmul_group, kernels._moe_token_stacked = originals
            for name, fn in halves.items():
                setattr(decode_ops, name, fn)
            decode_stack.try_decode = stack_original
        steps, alone = [], []
        lib = kernels._build.load()
        tiles = (ctypes.c_int64 * 2)()
        lib.strata_pool_tiles(tiles)
        before = list(tiles)
        threads_cpu = defaultdict(float)
        pool = (ctypes.c_int64 * 8)(), (ctypes.c_int64 * 8)()
        caller_cpu = 0.0
        lib.strata_pool_times(pool[0])
        lib.strata_pool_timing(1)
        for _ in range(repeats):
            t, by_thread, tt = time.process_time(), thread_cpu(), time.thread_time()
            token = model(token[:, None], cache, last_only=True)[:, 0].argmax(-1)
            steps.append(time.process_time() - t)
            caller_cpu += time.thread_time() - tt
            for kind, sec in thread_cpu().items():
                threads_cpu[kind] += sec - by_thread.get(kind, 0.0)
            lib.strata_pool_timing(0)
            t = time.process_time()
            for fn, args in calls:
                fn(*args)
            alone.append(time.process_time() - t)
            lib.strata_pool_timing(1)
        lib.strata_pool_timing(0)
        lib.strata_pool_times(pool[1])
    lib.strata_pool_tiles(tiles)
    helper, caller = tiles[0] - before[0], tiles[1] - before[1]
    share = f"; helper threads ran {100 * helper / (helper + caller):.0f}% of the shared tiles" if helper + caller else ""
    step, kern = statistics.median(steps) * 1e3, statistics.median(alone) * 1e3
    print(f"\n  replayed: {len(calls)} product calls alone {kern:.2f} ms CPU per token; the whole step "
          f"{step:.2f} ms CPU; outside the products {step - kern:.2f} ms ({100 * (step - kern) / step:.0f}%){share}")
    split = ", ".join(f"{kind} {1e3 * sec / repeats:.2f}" for kind, sec in sorted(threads_cpu.items()) if sec > 0)
    print(f"  CPU ms per decode step by thread: {split} (clock ticks of /proc, {repeats} steps)")
    d = [(pool[1][i] - pool[0][i]) / repeats for i in range(8)]
    ms = [v / 1e6 for v in d]
    print(f"  the kernel pool per step (CPU ms): calling thread {1e3 * caller_cpu / repeats:.2f}, of it in its tiles "
          f"{ms[0]:.2f}, waiting for a helper's last tile {ms[1]:.2f}, waking helpers {ms[7]:.2f}, serial outside pool "
          f"jobs {1e3 * caller_cpu / repeats - ms[3]:.2f}; helpers in tiles {ms[2]:.2f}; jobs shared {d[4]:.0f}, run "
          f"alone {d[5]:.0f}, that woke a sleeping helper {d[6]:.0f}")



MARKS = {1: "prepare x", 10: "attention half", 11: "ffn half", 12: "stack end"}  # (+ any a caller adds)
EV = 15  # int64 fields of one pool.c pool_event
T_IN, T_PUB, T_CALLER, T_OUT, H_FIRST, H_LAST, TAG, INFO, FN, N_TILES, C_TILES, H_TILES, C_IN, C_OUT, BYTES = range(EV)


def _job_name(e, names: dict) -> str:
    tag, info = e[TAG], e[INFO]
    if tag == 1:
        n, rows, cols = info & 0xFFFF, (info >> 16) & 0xFFFFFF, info >> 40
        return f"products {n}x{rows}x{cols}"
    if tag == 2:
        return f"router {info}"
    return names.setdefault(e[FN], f"fn#{len(names) + 1}")


def _shared(e) -> bool:
    return e[H_TILES] > 0 or e[T_PUB] != e[T_CALLER]


def print_timeline(engine, prompt: list[int], steps: int = 16, show: bool = True, marks: dict | None = None) -> None:
    """Where each decode token's time goes between the calling thread and the pool's helpers
    (pool.c's job timeline). Per token, medians: wall ms in pool jobs (publishing them, the calling
    thread's own tiles, its wait for a helper's last tile) and the helpers' start delay; the
    calling thread's CPU ms outside pool jobs (while the helpers have nothing to do), inside the
    one-call stack (preparing x, norms, routing, attention glue) and outside it (Python, embedding,
    the head's x, sampling); then one token's events in order. The CPU figures hold on a loaded
    machine; the wall ones include its descheduling."""
    from strata.runtime.generate import generate_step
    from strata.runtime.sampling import SamplingParams

    lib = kernels._build.load()
    model = engine.model
    tokens = generate_step(model, [prompt], SamplingParams(), model.new_cache(1))  # as bench_vs_llamacpp decodes
    with torch.inference_mode():
        for _ in range(4):
            next(tokens)
        bounds = []
        lib.strata_pool_trace(1)
        try:
            for _ in range(steps):
                t0, c0 = time.monotonic_ns(), time.thread_time_ns()
                next(tokens)
                bounds.append((t0, time.monotonic_ns(), c0, time.thread_time_ns()))
        finally:
            lib.strata_pool_trace(0)
    buf = (ctypes.c_int64 * (EV * 16384))()
    n = lib.strata_pool_trace_read(buf, 16384, EV)
    if n < 0:
        raise SystemExit(f"decode_profile: EV = {EV} is not the library's pool_event size (pool.c): update EV")
    ev = [tuple(buf[EV * i:EV * i + EV]) for i in range(n)]
    names: dict = {}
    rows = []
    for t0, t1, c0, c1 in bounds:
        mine = [e for e in ev if t0 <= e[T_IN] < t1]
        jobs = [e for e in mine if e[TAG] >= 0]
        shared = [e for e in jobs if _shared(e)]
        first = {-e[TAG]: e for e in reversed(mine) if e[TAG] < 0}  # each mark kind's first
        s0, s1 = first.get(10), first.get(12)
        in_stack = [e for e in jobs if s0 and s1 and s0[T_IN] <= e[T_IN] <= s1[T_IN]]
        job_cpu = sum(e[C_OUT] - e[C_IN] for e in jobs)
        stack_cpu = s1[C_IN] - s0[C_IN] if s0 and s1 else 0
        stack_serial = stack_cpu - sum(e[C_OUT] - e[C_IN] for e in in_stack)
        prep = 0
        for i, e in enumerate(mine):
            if e[TAG] == -1:
                nxt = next((f for f in mine[i + 1:] if f[TAG] >= 0), None)
                prep += nxt[C_IN] - e[C_IN] if nxt else 0
        ct, ht = sum(e[C_TILES] for e in shared), sum(e[H_TILES] for e in shared)
        rows.append(dict(
            wall=t1 - t0, cpu=c1 - c0, jobs=len(jobs), shared=len(shared),
            in_jobs=sum(e[T_OUT] - e[T_IN] for e in jobs), publish=sum(e[T_PUB] - e[T_IN] for e in shared),
            own=sum(e[T_CALLER] - e[T_PUB] for e in shared), wait=sum(e[T_OUT] - e[T_CALLER] for e in shared),
            delay=sum(max(e[H_FIRST] - e[T_PUB], 0) for e in shared if e[H_FIRST]),
            alone=sum(e[T_OUT] - e[T_IN] for e in jobs if not _shared(e)),
            serial=c1 - c0 - job_cpu, stack_serial=stack_serial, prep=prep,
            outside=c1 - c0 - job_cpu - stack_serial, share=ht / (ct + ht) if ct + ht else 0.0))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}

    def ms(v):
        return f"{v / 1e6:.2f}"

    print(f"\n  timeline of {steps} decode tokens, medians per token (uptime: {os.popen('uptime').read().strip()})")
    print(f"    token {ms(med['wall'])} ms wall, calling thread {ms(med['cpu'])} ms CPU; {med['jobs']:.0f} pool jobs, "
          f"{med['shared']:.0f} shared, helpers ran {100 * med['share']:.0f}% of their tiles")
    print(f"    wall in pool jobs {ms(med['in_jobs'])}: shared ones publishing (wake-ups) {ms(med['publish'])}, "
          f"caller's tiles {ms(med['own'])}, caller waiting for a helper's last tile {ms(med['wait'])}; "
          f"jobs run alone {ms(med['alone'])}; helpers' first tile after publication (summed) {ms(med['delay'])}")
    print(f"    calling thread CPU outside pool jobs (helpers idle) {ms(med['serial'])}: in the one-call stack "
          f"{ms(med['stack_serial'])} (of it preparing x {ms(med['prep'])}), outside it {ms(med['outside'])}")
    kinds: dict = defaultdict(list)  # the products' and routers' jobs by what they are: wall us, GB/s
    for t0, t1, _, _ in bounds:
        for e in ev:
            if t0 <= e[T_IN] < t1 and e[TAG] > 0 and e[BYTES]:
                kinds[_job_name(e, names)].append((e[T_OUT] - e[T_IN], e[BYTES], e[C_TILES], e[H_TILES]))
    print(f"    {'job (medians over the tokens)':<32} {'per token':>9} {'us':>8} {'GB/s':>6} {'caller tiles':>12}")
    for name, js in sorted(kinds.items(), key=lambda kv: -sum(j[0] for j in kv[1])):
        us = statistics.median(j[0] for j in js) / 1e3
        nb = statistics.median(j[1] for j in js)
        share = sum(j[2] for j in js) / max(1, sum(j[2] + j[3] for j in js))
        print(f"    {name:<32} {len(js) / len(bounds):9.1f} {us:8.1f} {nb / us / 1e3:6.1f} {100 * share:11.0f}%")
    if not show:
        return
    t0, t1, c0, _ = bounds[len(bounds) // 2]
    mine = [e for e in ev if t0 <= e[T_IN] < t1]
    print(f"    one token's events (wall us from its start; cpu: the calling thread's CPU us since the last event)")
    print(f"      {'at':>9} {'what':<28} {'gap':>7} {'cpu':>7} {'pub':>6} {'caller':>7} {'wait':>6} {'h.start':>7} "
          f"{'tiles c/h':>10}")
    last, lastc = t0, c0
    names_of = {**MARKS, **(marks or {})}
    for e in mine:
        head = f"      {(e[T_IN] - t0) / 1e3:9.1f}"
        if e[TAG] < 0:
            what = f"> {names_of.get(-e[TAG], str(-e[TAG]))} {e[INFO]}"
            print(f"{head} {what:<28} {(e[T_IN] - last) / 1e3:7.1f} {(e[C_IN] - lastc) / 1e3:7.1f}")
            last, lastc = e[T_IN], e[C_IN]
            continue
        sh = _shared(e)
        start = f"{(e[H_FIRST] - e[T_PUB]) / 1e3:7.1f}" if sh and e[H_FIRST] else f"{'':>7}"
        print(f"{head} {_job_name(e, names):<28} {(e[T_IN] - last) / 1e3:7.1f} {(e[C_IN] - lastc) / 1e3:7.1f} "
              f"{(e[T_PUB] - e[T_IN]) / 1e3:6.1f} {(e[T_CALLER] - e[T_PUB]) / 1e3:7.1f} {(e[T_OUT] - e[T_CALLER]) / 1e3:6.1f} "
              f"{start} {e[C_TILES]:>5}/{e[H_TILES]:<4}")
        last, lastc = e[T_OUT], e[C_OUT]
    print(f"      {(t1 - t0) / 1e3:9.1f} {'token end':<28} {(t1 - last) / 1e3:7.1f}")
