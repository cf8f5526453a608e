"""Per-kernel speed of strata.kernels against the reference path and the machine's memory bandwidth.

    .venv/bin/python bench/bench_kernels.py                     # all kernel types, 2 shapes, B=1 and 8
    .venv/bin/python bench/bench_kernels.py --types Q4_K IQ2_XS --threads 1 2
    .venv/bin/python bench/bench_kernels.py --batches          # fast vs reference crossover (FAST_BATCH_MAX)
    .venv/bin/python bench/bench_kernels.py --compare-numba    # the tool choice: C vs numba on Q4_K
    .venv/bin/python bench/bench_kernels.py --prompt-crossover --threads 1   # prefill: PROMPT_MIN_ROWS
    .venv/bin/python bench/bench_kernels.py --prompt-avx2 --threads 1   # prefill without AMX: PROMPT_AVX2_MIN_ROWS
    .venv/bin/python bench/bench_kernels.py --prompt-amx --types Q4_K IQ2_XS --threads 1
                                                  # prefill: the AMX product (prefill.c) vs the 8-bit
                                                  # kernel vs ggml-dequantized float32 matmul, by rows
    .venv/bin/python bench/bench_kernels.py --fused-ab --types Q4_K IQ2_XS --threads 1
                                                  # q8x2 in one pass (each kernel set: AVX-512 VNNI,
                                                  # AVX-VNNI, AVX2) vs ggml's vec_dot run twice
    .venv/bin/python bench/bench_kernels.py --multirow-ab --types Q4_K IQ2_XS --threads 1
                                                  # a B-row q8x2 product (a verify pass, a decode
                                                  # batch): multi-row kernels vs each row its one-row
                                                  # kernel vs B one-row products, CPU ms
    .venv/bin/python bench/bench_kernels.py --compare-ggml --types Q4_0 Q4_K IQ2_XS --threads 1 2
                                                  # the kept library: ggml (ggml-python) on the same blocks
    .venv/bin/python bench/bench_kernels.py --moe-token --types Q4_K IQ2_XS --threads 1 2 --experts 128
                                                  # a decode token's 8 routed experts, as a MoE layer runs them

Weights are Qwen3-30B-A3B expert matrices (gate/up 768x2048, down 2048x768), N_EXPERTS of them
cycled so the working set does not fit the caches, as on the expert miss path. GB/s counts the
quantized weight bytes read per second; "%bw" relates it to a big torch copy (bytes read +
written per second), the machine's practical memory bandwidth. Times are medians of many calls
(min in brackets); on a shared machine look at the load average printed first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata import kernels  # noqa: E402
from strata.kernels import _build  # noqa: E402
from strata.formats.weights import QTensor  # noqa: E402
from strata.synth import random_blocks  # noqa: E402

SHAPES = {"gate/up 768x2048": (768, 2048), "down 2048x768": (2048, 768)}


def timed(fn, reps: int, budget_s: float = 2.0, clock=time.perf_counter) -> tuple[float, float]:
    """(median, min) seconds per call by `clock` (process_time: CPU seconds, steadier on a shared
    machine for a one-thread call); stops early after budget_s of wall time."""
    fn()
    ts = []
    t_end = time.perf_counter() + budget_s
    for _ in range(reps):
        t = clock()
        fn()
        ts.append(clock() - t)
        if time.perf_counter() > t_end and len(ts) >= 5:
            break
    return statistics.median(ts), min(ts)


def memory_bandwidth(mb: int = 512) -> float:
    """GB/s of a big tensor copy, counting bytes read plus bytes written."""
    a = torch.ones(mb * 2**20 // 4)
    b = torch.empty_like(a)
    med, best = timed(lambda: b.copy_(a), 10)
    return 2 * a.numel() * 4 / best / 1e9


def experts(qtype: T, shape, n: int, seed: int = 0) -> list[QTensor]:
    from strata import quant

    q = quant.get(qtype)
    rows, cols = shape
    n_blocks = n * rows * cols // q.block_size
    if qtype == T.IQ1_M:  # synth has no IQ1_M blocks: random bits, the split f16 scale set to 0.01
        blocks = np.random.default_rng(seed).integers(0, 256, (n_blocks, q.type_size), dtype=np.uint8)
        words = blocks[:, 48:56].copy().view(np.uint16)
        h = int(np.float16(0.01).view(np.uint16))
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((h >> (4 * k)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    else:
        blocks = random_blocks(qtype, n_blocks, np.random.default_rng(seed))
    raw = torch.from_numpy(blocks.reshape(n, rows, -1))
    return [QTensor(raw[e], qtype, shape) for e in range(n)]


def bench_types(types, threads_list, batches, n_experts, bw):
    print(f"{'type':<8} {'shape':<17} {'thr':>3} {'B':>2} | {'fast ms':>14} {'GB/s':>6} {'%bw':>4} | "
          f"{'ref ms':>7} {'speedup':>7}")
    for name in types:
        qtype = T[name]
        for label, shape in SHAPES.items():
            ws = experts(qtype, shape, n_experts)
            nbytes = ws[0].nbytes
            for threads in threads_list:
                torch.set_num_threads(threads)
                for b in batches:
                    x = torch.randn(b, shape[1])
                    out = torch.empty(b, shape[0])
                    it = iter(range(10**9))

                    def fast():
                        kernels.qmatmul_fast(x, ws[next(it) % n_experts], threads=threads, out=out)

                    def ref():
                        kernels.qmatmul_reference(x, ws[next(it) % n_experts])

                    med, best = timed(fast, 400)
                    rmed, _ = timed(ref, 20, budget_s=1.0)
                    gbs = nbytes / med / 1e9
                    print(f"{name:<8} {label:<17} {threads:>3} {b:>2} | {med * 1e3:6.3f} ({best * 1e3:5.3f}) "
                          f"{gbs:6.2f} {100 * gbs / bw:4.0f} | {rmed * 1e3:7.2f} {rmed / med:7.1f}x", flush=True)


def bench_batches(threads):
    torch.set_num_threads(threads)
    print(f"fast kernel vs dequantize+matmul by batch size (Q4_K, 768x2048, {threads} threads)")
    ws = experts(T.Q4_K, (768, 2048), 16)
    for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96):
        x = torch.randn(b, 2048)
        it = iter(range(10**9))
        fmed, _ = timed(lambda: kernels.qmatmul_fast(x, ws[next(it) % 16], threads=threads), 100, 1.0)
        rmed, _ = timed(lambda: kernels.qmatmul_reference(x, ws[next(it) % 16]), 20, 1.0)
        print(f"  B={b:3d}: fast {fmed * 1e3:7.3f} ms  reference {rmed * 1e3:7.3f} ms  -> "
              f"{'fast' if fmed < rmed else 'reference'}", flush=True)


# --- the tool choice: the same Q4_K matrix-vector product in numba (parallel prange, no fastmath)

def _numba_q4k():
    from numba import njit, prange

    @njit(inline="always")
    def f16(h):
        s = (h >> 15) & 1
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        v = np.float32(m) * np.float32(2.0 ** -24) if e == 0 else \
            (np.float32(1.0) + np.float32(m) / np.float32(1024.0)) * np.float32(2.0 ** (int(e) - 15))
        return -v if s else v

    @njit(parallel=True, fastmath=False)
    def q4k_mv(W, x, y, nblk):
        for r in prange(W.shape[0]):
            acc = np.float32(0.0)
            for j in range(nblk):
                o = j * 144
                d = f16(np.uint16(W[r, o]) | (np.uint16(W[r, o + 1]) << np.uint16(8)))
                dmin = f16(np.uint16(W[r, o + 2]) | (np.uint16(W[r, o + 3]) << np.uint16(8)))
                for jj in range(8):
                    if jj < 4:
                        sc = W[r, o + 4 + jj] & 63
                        mn = W[r, o + 8 + jj] & 63
                    else:
                        sc = (W[r, o + 8 + jj] & 0xF) | ((W[r, o + jj] >> 2) & 0x30)
                        mn = (W[r, o + 8 + jj] >> 4) | ((W[r, o + 4 + jj] >> 2) & 0x30)
                    base = j * 256 + 32 * jj
                    q0 = o + 16 + 32 * (jj // 2)
                    sh = 4 * (jj % 2)
                    s = np.float32(0.0)
                    sx = np.float32(0.0)
                    for l in range(32):
                        s += np.float32((W[r, q0 + l] >> sh) & 0xF) * x[base + l]
                        sx += x[base + l]
                    acc += d * np.float32(sc) * s - dmin * np.float32(mn) * sx
            y[r] = acc

    return q4k_mv


def compare_numba(threads_list):
    try:
        import numba
    except ImportError:
        print("numba is not installed; pip install numba to reproduce the comparison")
        return
    ws = experts(T.Q4_K, (768, 2048), 16)
    x = torch.randn(1, 2048)
    t0 = time.perf_counter()
    q4k_mv = _numba_q4k()
    y = np.zeros(768, np.float32)
    q4k_mv(ws[0].raw.numpy(), x[0].numpy(), y, 8)
    compile_s = time.perf_counter() - t0
    ref = kernels.qmatmul_reference(x, ws[0])[0]
    err = float(np.abs(y - ref.numpy()).max() / ref.abs().max())
    print(f"numba {numba.__version__}: compile {compile_s:.1f} s, rel. error {err:.1e}")
    for threads in threads_list:
        numba.set_num_threads(threads)
        torch.set_num_threads(threads)
        it = iter(range(10**9))
        nmed, nbest = timed(lambda: q4k_mv(ws[next(it) % 16].raw.numpy(), x[0].numpy(), y, 8), 200)
        cmed, cbest = timed(lambda: kernels.qmatmul_fast(x, ws[next(it) % 16], threads=threads), 400)
        rmed, rbest = timed(lambda: kernels.qmatmul_reference(x, ws[next(it) % 16]), 20)
        print(f"  Q4_K 768x2048 matvec, {threads} thread(s): C {cmed * 1e3:.3f} ms (min {cbest * 1e3:.3f})  "
              f"numba {nmed * 1e3:.3f} ms (min {nbest * 1e3:.3f})  "
              f"torch dequantize+matmul {rmed * 1e3:.2f} ms (min {rbest * 1e3:.2f})")


# --- the kept library: ggml's own CPU kernels (ggml-python) on the very same blocks, no copies

class GgmlMatVec:
    """y = W x by ggml_mul_mat in a one-node graph, W's data pointer aimed at a torch tensor's bytes.

    The context holds only tensor headers (no_alloc); W and y point into torch memory, so
    switching experts is one pointer store. x is float32; ggml quantizes it (q8_K / q8_0) itself.
    """

    def __init__(self, ggml, qtype: T, shape, threads: int):
        import ctypes

        self.g = ggml
        rows, cols = shape
        self.ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 * 2**20, mem_buffer=None, no_alloc=True))
        self.w = ggml.ggml_new_tensor_2d(self.ctx, int(qtype), cols, rows)
        self.x = ggml.ggml_new_tensor_2d(self.ctx, ggml.GGML_TYPE_F32, cols, 1)
        self.y = ggml.ggml_mul_mat(self.ctx, self.w, self.x)
        self.gf = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(self.gf, self.y)
        tp = ggml.ggml_threadpool_params_default(threads)
        self.pool = ggml.ggml_threadpool_new(ctypes.byref(tp))
        self.plan = ggml.ggml_graph_plan(self.gf, threads, self.pool)
        self.work = torch.empty(max(self.plan.work_size, 1), dtype=torch.uint8)
        self.plan.work_data = ctypes.cast(self.work.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        self.xt = torch.empty(1, cols)
        self.yt = torch.empty(1, rows)
        self.x.contents.data = self.xt.data_ptr()
        self.y.contents.data = self.yt.data_ptr()
        self._plan_p = ctypes.byref(self.plan)

    def __call__(self, w: QTensor, x: torch.Tensor) -> torch.Tensor:
        self.xt.copy_(x)  # or aim x.data at the caller's tensor: also one pointer store
        self.w.contents.data = w.raw.data_ptr()
        self.g.ggml_graph_compute(self.gf, self._plan_p)
        return self.yt

    def close(self):
        self.g.ggml_threadpool_free(self.pool)
        self.g.ggml_free(self.ctx)


def compare_ggml(types, threads_list, n_experts):
    try:
        import ggml
    except ImportError:
        print("ggml-python is not installed; pip install ggml-python==0.0.45 (builds from source) to compare")
        return
    from strata.synth import random_blocks as _rb  # noqa: F401  (same blocks as bench_types)

    print(f"{'type':<8} {'shape':<17} {'thr':>3} | {'strata ms':>16} {'ggml ms':>16} {'ggml/strata':>11} "
          f"| max rel. diff vs exact (strata, ggml)")
    for name in types:
        qtype = T[name]
        for label, shape in SHAPES.items():
            ws = experts(qtype, shape, n_experts)
            x = torch.randn(1, shape[1])
            ref = kernels.qmatmul_reference(x, ws[0])
            scale = float(ref.abs().max())
            for threads in threads_list:
                torch.set_num_threads(threads)
                mv = GgmlMatVec(ggml, qtype, shape, threads)
                e_g = float((mv(ws[0], x) - ref).abs().max()) / scale
                e_s = float((kernels.qmatmul_fast(x, ws[0], threads=threads) - ref).abs().max()) / scale
                out = torch.empty(1, shape[0])
                it = iter(range(10**9))
                smed, sbest = timed(lambda: kernels.qmatmul_fast(x, ws[next(it) % n_experts], threads=threads,
                                                                 out=out), 400)
                gmed, gbest = timed(lambda: mv(ws[next(it) % n_experts], x), 400)
                mv.close()
                print(f"{name:<8} {label:<17} {threads:>3} | {smed * 1e3:7.3f} ({sbest * 1e3:6.3f}) "
                      f"{gmed * 1e3:7.3f} ({gbest * 1e3:6.3f}) {gbest / sbest:11.2f} | {e_s:.1e} {e_g:.1e}",
                      flush=True)


def prompt_crossover(types, threads):
    """Rows of x from which dequantizing W (ggml) + one matmul beats the 8-bit kernel, in the
    current activation mode (bf16 in "q8", float32 in "q8x2"). Both are timed at each row count:
    the multi-row kernels unpack a block once for several rows, so rows x the one-row time
    overstates the kernel."""
    torch.set_num_threads(threads)
    dt = torch.bfloat16 if kernels.activations() == "q8" else torch.float32
    table = kernels.prompt_min_rows(dt)
    rows_list = (4, 8, 12, 16, 24, 32, 40, 48, 64)
    clock = time.process_time if threads == 1 else time.perf_counter
    print(f"{dt} batched product vs 8-bit kernel ({kernels.activations()}), 768x2048, {threads} thread(s), "
          f"{'CPU' if threads == 1 else 'wall'} ms per product (kernel / dequantize + matmul) by rows")
    for name in types:
        ws = experts(T[name], (768, 2048), 4)
        if kernels.dequantize_ggml(ws[0]) is None:
            print(f"  {name:<8} no ggml to_float")
            continue
        it = iter(range(10**9))
        cells, cross = [], None
        for rows in rows_list:
            x = torch.randn(rows, 2048)
            k8, _ = timed(lambda: kernels.try_qmatmul(x, ws[next(it) % 4], threads), 50, 0.4, clock)
            dq, _ = timed(lambda: torch.nn.functional.linear(
                x.to(dt), kernels.dequantize_ggml(ws[next(it) % 4], dt, threads)), 50, 0.4, clock)
            cells.append(f"{rows}: {k8 * 1e3:.2f}/{dq * 1e3:.2f}")
            if cross is None and dq < k8:
                cross = rows
        print(f"  {name:<8} crossover {cross if cross else '>' + str(rows_list[-1]):>4} rows "
              f"(in use: {table.get(name, 32)}) | " + "  ".join(cells), flush=True)


def prompt_avx2(types, threads):
    """ms per 768x2048 product by rows of x: prefill_avx2.h's float32 product (own AVX2 decoders into
    float32 tiles + FMA micro-kernel), the 8-bit decode kernel (q8x2) and ggml's float32
    dequantization + one torch matmul (the path before it), CPU ms at 1 thread; the crossover is
    the first row count from which the first beats the second (PROMPT_AVX2_MIN_ROWS)."""
    from strata.kernels import prompt

    torch.set_num_threads(threads)
    if prompt.backend() != "avx2":
        print(f"the prompt backend here is {prompt.backend()}, not avx2")
        return
    clock = time.process_time if threads == 1 else time.perf_counter
    print(f"768x2048, {threads} thread(s), {'CPU' if threads == 1 else 'wall'} ms per product: "
          "avx2 f32 / 8-bit kernel / ggml f32 + matmul")
    for name in types:
        if not prompt.has_type(T[name]):
            continue
        ws = experts(T[name], (768, 2048), 4)
        it = iter(range(10**9))
        cells, cross = [], None
        for rows in (1, 4, 6, 8, 10, 12, 16, 24, 32, 64, 512):
            x = torch.randn(rows, 2048)
            reps = 5 if rows > 64 else 30
            a, _ = timed(lambda: prompt.matmul(x, ws[next(it) % 4], threads), reps, 0.6, clock)
            k8 = float("nan")
            if rows <= kernels.FAST_BATCH_MAX:
                k8, _ = timed(lambda: kernels.try_qmatmul(x, ws[next(it) % 4], threads), reps, 0.6, clock)
            f32 = float("nan")
            if rows > 4 and kernels.dequantize_ggml(ws[0], torch.float32) is not None:
                f32, _ = timed(lambda: x @ kernels.dequantize_ggml(ws[next(it) % 4], torch.float32, threads).T, reps,
                               0.6, clock)
            if cross is None and a < k8:
                cross = rows
            cells.append(f"{rows}: {a * 1e3:.2f}/{k8 * 1e3:.2f}/{f32 * 1e3:.2f}")
        print(f"  {name:<8} crossover {cross} (in use: {kernels._prompt_min_rows(T[name])}) | "
              + "  ".join(cells), flush=True)


def prompt_amx(types, threads):
    """ms per 768x2048 product by rows of x: prefill.c's AMX product (3 terms: "q8x2", 1: "q8"), the
    8-bit decode kernel, and ggml's float32 dequantization + one matmul (the path before it);
    PROMPT_AMX_MIN_ROWS comes from where the first beats the second."""
    from strata.kernels import prompt

    torch.set_num_threads(threads)
    if not prompt.available():
        print("no AMX-BF16 here")
        return
    print(f"768x2048, {threads} thread(s), ms per product: amx3 / amx1 / 8-bit kernel / ggml f32 + matmul")
    for name in types:
        if not prompt.has_type(T[name]):
            continue
        ws = experts(T[name], (768, 2048), 4)
        it = iter(range(10**9))
        cells = []
        for rows in (1, 4, 6, 8, 16, 32, 64):
            x = torch.randn(rows, 2048)
            a3, _ = timed(lambda: prompt.matmul(x, ws[next(it) % 4], threads, 3), 50, 0.5)
            a1, _ = timed(lambda: prompt.matmul(x, ws[next(it) % 4], threads, 1), 50, 0.5)
            k8, _ = timed(lambda: kernels.try_qmatmul(x, ws[next(it) % 4], threads), 50, 0.5)
            f32 = float("nan")
            if kernels.dequantize_ggml(ws[0], torch.float32) is not None:
                f32, _ = timed(lambda: x @ kernels.dequantize_ggml(ws[next(it) % 4], torch.float32, threads).T, 20, 0.5)
            cells.append(f"{rows}: {a3 * 1e3:.2f}/{a1 * 1e3:.2f}/{k8 * 1e3:.2f}/{f32 * 1e3:.2f}")
        own = "own" if prompt.has_type(T[name], own_only=True) else "ggml"
        print(f"  {name:<8} ({own} dequantizer) " + "  ".join(cells), flush=True)


def fused_ab(types, threads_list, n_experts):
    """q8x2 in one pass (qmm.c's fused kernels, each kernel set this CPU runs: AVX-512 VNNI,
    AVX-VNNI, AVX2) against ggml's vec_dot run twice, B=1: all alternate in rounds of calls so
    load changes hit each; medians over the rounds. Speed-ups are two passes / one pass."""
    lib = _build.load()
    kernels.set_activations("q8x2")
    isas = [n for n, bit in sorted(_build.KERNEL_ISAS.items(), key=lambda kv: -kv[1]) if lib.strata_fused_isas() >> bit & 1]
    print(f"{'type':<8} {'shape':<17} {'thr':>3} | {'two-pass ms':>11} | " +
          " | ".join(f"{isa + ' ms':>14} {'speedup':>7}" for isa in isas))
    for name in types:
        if name not in kernels.ggml_types() or not isas or not lib.strata_fused_types(int(T[name])):
            print(f"{name:<8} no one-pass kernel on this CPU")
            continue
        for label, shape in SHAPES.items():
            ws = experts(T[name], shape, n_experts)
            x = torch.randn(1, shape[1])
            out = torch.empty(1, shape[0])
            for threads in threads_list:
                it = iter(range(10**9))

                def call():
                    kernels.qmatmul_fast(x, ws[next(it) % n_experts], threads=threads, out=out)

                times = {k: [] for k in ("two", *isas)}
                try:
                    for _ in range(15):
                        lib.strata_set_fused(0)
                        times["two"].append(timed(call, 40, budget_s=0.2)[0])
                        lib.strata_set_fused(1)
                        for isa in isas:
                            lib.strata_set_fused_isa(_build.KERNEL_ISAS[isa])
                            times[isa].append(timed(call, 40, budget_s=0.2)[0])
                finally:
                    lib.strata_set_fused(1)
                    lib.strata_set_fused_isa(-1)
                med = {k: statistics.median(v) for k, v in times.items()}
                print(f"{name:<8} {label:<17} {threads:>3} | {med['two'] * 1e3:11.3f} | " +
                      " | ".join(f"{med[isa] * 1e3:14.3f} {med['two'] / med[isa]:6.2f}x" for isa in isas), flush=True)


def multirow_ab(types, threads_list, n_experts, batches=(2, 4, 8, 17)):
    """A B-row q8x2 product three ways, alternating in rounds so load changes hit each: the
    multi-row kernels (each weight block unpacked once for all B rows), the same call with them off
    (each row its one-row kernel), and B one-row products (B decode steps' worth). CPU ms per
    product (process time: the other helpers' load does not count), medians over the rounds; the
    ratios are to the B one-row products. Each row's result is checked bit-equal across the three."""
    lib = _build.load()
    kernels.set_activations("q8x2")
    print(f"{'type':<8} {'shape':<17} {'thr':>3} {'B':>3} | {'B x 1-row ms':>12} | {'off ms':>8} {'ratio':>6} | "
          f"{'multi ms':>8} {'ratio':>6} | multi / off")
    for name in types:
        if name not in kernels.ggml_types() or not lib.strata_fused_types(int(T[name])):
            print(f"{name:<8} no one-pass kernel on this CPU")
            continue
        for label, shape in SHAPES.items():
            ws = experts(T[name], shape, n_experts)
            for threads in threads_list:
                for B in batches:
                    x = torch.randn(B, shape[1])
                    out = torch.empty(B, shape[0])
                    one = torch.empty(1, shape[0])
                    it = iter(range(10**9))

                    def rows_one():
                        w = ws[next(it) % n_experts]
                        for i in range(B):
                            kernels.qmatmul_fast(x[i:i + 1], w, threads=threads, out=one)

                    def rows_all():
                        kernels.qmatmul_fast(x, ws[next(it) % n_experts], threads=threads, out=out)

                    def cpu(fn, reps=20):
                        fn()
                        t = time.process_time()
                        for _ in range(reps):
                            fn()
                        return (time.process_time() - t) / reps

                    times = {"one": [], "off": [], "on": []}
                    try:
                        for _ in range(7):
                            times["one"].append(cpu(rows_one))
                            lib.strata_set_multirow(0)
                            times["off"].append(cpu(rows_all))
                            lib.strata_set_multirow(1)
                            times["on"].append(cpu(rows_all))
                        w = ws[0]
                        lib.strata_set_multirow(0)
                        off = kernels.qmatmul_fast(x, w, threads=threads)
                        lib.strata_set_multirow(1)
                        on = kernels.qmatmul_fast(x, w, threads=threads)
                        alone = torch.cat([kernels.qmatmul_fast(x[i:i + 1], w, threads=threads) for i in range(B)])
                        if not (torch.equal(on, off) and torch.equal(on, alone)):
                            raise RuntimeError(f"{name} B={B}: a row differs from its one-row product")
                    finally:
                        lib.strata_set_multirow(1)
                    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                    print(f"{name:<8} {label:<17} {threads:>3} {B:>3} | {med['one']:12.3f} | {med['off']:8.3f} "
                          f"{med['off'] / med['one']:6.2f} | {med['on']:8.3f} {med['on'] / med['one']:6.2f} | "
                          f"{med['on'] / med['off']:.2f}", flush=True)


def moe_token(types, threads_list, n_experts, k: int = 8, reps: int = 200):
    """One decode token's routed experts as a MoE layer runs them (qmm.c's two parallel regions:
    every expert's gate and up over one quantized x, then every down), k of n_experts Qwen3-30B
    experts drawn at random per call (the working set beyond the caches): ms per call and GB/s of
    the weights read, at each thread count, the same draws for each."""
    import ctypes

    lib = _build.load()
    if kernels.activations() not in ("q8", "q8x2"):
        print(f"--moe-token needs an 8-bit activation mode (now {kernels.activations()})")
        return
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    print(f"{'type':<8} {'experts':>7} {'k':>2} {'thr':>3} | {'ms':>7} {'GB/s':>6}")
    for name in types:
        qt = T[name]
        up_rows, cols = SHAPES["gate/up 768x2048"]
        gates, ups = experts(qt, (up_rows, cols), n_experts, 1), experts(qt, (up_rows, cols), n_experts, 2)
        downs = experts(qt, (cols, up_rows), n_experts, 3)
        x = torch.randn(cols)
        g = torch.empty(2 * k, up_rows)
        h = torch.randn(k, up_rows) * 0.1
        y = torch.empty(k, cols)
        draws = [torch.randperm(n_experts, generator=torch.Generator().manual_seed(i))[:k].tolist() for i in range(reps)]
        nbytes = k * (2 * gates[0].nbytes + downs[0].nbytes)

        def arrays(ws, xs, ys, rows, cols_):
            n = len(ws)
            return (n, (ctypes.c_int * n)(*[int(qt)] * n), (p * n)(*[_build.raw_bytes(w).data_ptr() for w in ws]),
                    (i64 * n)(*[rows] * n), (i64 * n)(*[cols_] * n), (i64 * n)(*[ws[0].nbytes // rows] * n),
                    (p * n)(*xs), (p * n)(*ys))

        calls = []
        for d in draws:
            gu = [w for e in d for w in (gates[e], ups[e])]
            calls.append((arrays(gu, [x.data_ptr()] * (2 * k), [g[j].data_ptr() for j in range(2 * k)], up_rows, cols),
                          arrays([downs[e] for e in d], [h[j].data_ptr() for j in range(k)],
                                 [y[j].data_ptr() for j in range(k)], cols, up_rows)))
        for threads in threads_list:
            def run(c):
                for a in c:
                    if not lib.strata_qmm_many(*a[:7], 1, a[7], threads):
                        raise RuntimeError("strata_qmm_many declined")
            run(calls[0])
            ts = []
            for c in calls:
                t = time.perf_counter()
                run(c)
                ts.append(time.perf_counter() - t)
            med = statistics.median(ts)
            print(f"{name:<8} {n_experts:>7} {k:>2} {threads:>3} | {med * 1e3:7.3f} {nbytes / med / 1e9:6.2f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", nargs="*", default=list(_build.KERNEL_TYPES))
    ap.add_argument("--threads", nargs="*", type=int, default=[torch.get_num_threads()])
    ap.add_argument("--batch", nargs="*", type=int, default=[1, 8])
    ap.add_argument("--experts", type=int, default=48, help="matrices cycled per measurement (defeats caches)")
    ap.add_argument("--batches", action="store_true", help="only the batch-size crossover")
    ap.add_argument("--compare-numba", action="store_true", help="only C vs numba on Q4_K")
    ap.add_argument("--compare-ggml", action="store_true", help="only strata vs ggml (ggml-python) mat-vec")
    ap.add_argument("--prompt-crossover", action="store_true", help="only the batched vs 8-bit kernel crossover")
    ap.add_argument("--fused-ab", action="store_true", help="only q8x2 one pass vs ggml's two passes")
    ap.add_argument("--multirow-ab", action="store_true",
                    help="only a B-row q8x2 product: multi-row kernels vs one-row kernels vs B one-row products")
    ap.add_argument("--prompt-amx", action="store_true", help="only the AMX prompt product vs the others, by rows")
    ap.add_argument("--prompt-avx2", action="store_true",
                    help="only the AVX2 float32 prompt product vs the others, by rows (PROMPT_AVX2_MIN_ROWS)")
    ap.add_argument("--moe-token", action="store_true",
                    help="only a decode token's k=8 routed experts (gate/up, then down) as a MoE layer runs them")
    args = ap.parse_args(argv)
    if not kernels.available():
        print(f"kernels unavailable: {_build.error()}")
        return 1
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; torch {torch.__version__}")
    if args.compare_numba:
        compare_numba(args.threads)
        return 0
    if args.prompt_crossover:
        prompt_crossover([t for t in args.types if t in kernels.ggml_types()], args.threads[0])
        return 0
    if args.prompt_amx:
        prompt_amx(args.types, args.threads[0])
        return 0
    if args.prompt_avx2:
        prompt_avx2(args.types, args.threads[0])
        return 0
    if args.fused_ab:
        fused_ab(args.types, args.threads, args.experts)
        return 0
    if args.multirow_ab:
        multirow_ab(args.types, args.threads, args.experts)
        return 0
    if args.compare_ggml:
        compare_ggml(args.types, args.threads, args.experts)
        return 0
    if args.moe_token:
        moe_token(args.types, args.threads, args.experts)
        return 0
    if args.batches:
        bench_batches(args.threads[0])
        return 0
    bw = memory_bandwidth()
    print(f"memory bandwidth (512 MiB torch copy, read+write): {bw:.1f} GB/s")
    bench_types(args.types, args.threads, args.batch, args.experts, bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
