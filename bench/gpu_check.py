"""The prepared GPU check: each Triton kernel's GB/s, tiered decode speed, kernel tests on CUDA.

    python bench/gpu_check.py [--out DIR] [--skip kernels,decode,tests] [--tokens 64]
    python bench/gpu_check.py --dry-run    # on a CPU: the same steps, Triton's interpreter, tiny shapes,
                                           # and every kernel compiled for sm_90 (~5 minutes on 2 cores)

Sized for a session lent one GPU for 15 minutes in all (an H200): under 8 minutes; past 7.5
the remaining parts are skipped, and a failing step is reported without stopping the rest.
1. kernels: per ggml type, `x @ W.T` for one row of x, and the grouped SwiGLU product over
   cache slots at Qwen3-30B-A3B's expert size (a decode step's 8 experts; 4 tokens' 32), each
   with its error against the torch reference: achieved GB/s of weight bytes against the
   device's peak bandwidth (by its name) and a measured device-to-device copy, next to the
   reference's time. Timed calls cycle over 256 MB of weights, so L2 cannot serve them. The
   prefill product (512 x 4096 rows through the tiled kernel from blocks) beside dequantize +
   matmul per call and cuBLAS on a bf16 copy.
2. decode: the demo model with the expert cache at 0, 30, 70 and 100 %: tokens/s and hit
   rates, with the device half computed by Triton and by the torch reference, side by side.
   2b. a 12-layer qwen4exp synth at the real model's tensor shapes (IQ2_XS, `--router-skew`,
   128 experts a layer by default): bf16 decode tok/s with the expert cache at 30 % and 70 % of the
   experts and with all of them resident, each beside its bandwidth limit (device bytes per
   token over the device's bandwidth, missed experts' bytes over the measured RAM bandwidth).
   2c. the same model at 70 %: CUDA graphs off and on (kernels/gpu/graphs.py), and prefetch off
   (its copies overlap the next layer's attention), tok/s and whether the tokens agree; the plan's
   dense forms (blocks or bf16 dequantized at placement).
3. tests: tests/test_triton_kernels.py (compiled on the device) and every gpu-marked test.
Without CUDA (and without --dry-run) it stops at once with exit code 2.

On the lent machine (Python 3.12 with torch and triton, but no gguf): first, here, put the gguf
wheel in an ignored .whl/ folder (`echo /.whl/ >> .git/info/exclude; python3 -m pip download
--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform
manylinux2014_x86_64 -d .whl gguf==0.19.0`), then run, carrying .whl:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "strata" / "demo" / "strata-demo.gguf"
BUDGET_S = 7.5 * 60  # later steps are cut short past this
PROMPT = 'def read_config(path):\n    """Read a JSON config file and return a dict."""\n'

# Peak DRAM bandwidth by device name (first match wins, so specific names come first), bytes/s.
PEAK_BANDWIDTH = (("GH200", 4.0e12), ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12),
                  ("H100", 3.35e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12),
                  ("A100", 1.555e12), ("L40S", 0.864e12), ("RTX 4090", 1.008e12), ("RTX 5090", 1.792e12))

START = time.perf_counter()


def out_of_time() -> bool:
    return time.perf_counter() - START > BUDGET_S


def preflight(dry_run: bool) -> torch.device:
    """CUDA and Triton present, or a clear message and exit 2; --dry-run uses the interpreter."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before strata.kernels.gpu first imports its kernels
        return torch.device("cpu")
    if not torch.cuda.is_available():
        fail("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine, "
             "or with --dry-run to check the script on this CPU under Triton's interpreter")
    try:
        import triton  # noqa: F401
    except ImportError:
        fail("gpu_check: triton is not installed; pip install 'strata[gpu]'")
    return torch.device("cuda")


def fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn, device: torch.device, iters: int = 20, reps: int = 5) -> float:
    """Median over reps of the mean time of `iters` back-to-back calls, after warm-up."""
    if device.type != "cuda":
        iters, reps = 1, 1
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def peak_bandwidth(device: torch.device) -> tuple[str, float | None, float | None]:
    """(device name, peak bytes/s by name or None, measured device-to-device copy bytes/s or None)."""
    if device.type != "cuda":
        return "CPU (Triton interpreter)", None, None
    name = torch.cuda.get_device_name(device)
    peak = next((bw for key, bw in PEAK_BANDWIDTH if key in name), None)
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy = 2 * a.numel() / seconds_per_call(partial(b.copy_, a), device, iters=10, reps=3)  # read + write
    return name, peak, copy


# ----------------------------------------------------------------------------- tests


def run_tests() -> dict:
    gpu_marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                        if "mark.gpu" in p.read_text() and p.name != "test_triton_kernels.py")
    runs = {"triton": ["tests/test_triton_kernels.py"], "gpu-marked": [*gpu_marked, "-m", "gpu"]}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests choose
    results = {}
    for label, args in runs.items():
        if out_of_time():
            results[label] = "skipped: out of time"
            continue
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=240, check=False)
        except subprocess.TimeoutExpired as e:
            results[label] = "failed: timed out after 240 s"
            print(f"  {label:<11} {results[label]}\n{(e.stdout or b'')[-3000:]}", flush=True)
            continue
        lines = done.stdout.strip().splitlines() or ["(no output)"]
        summary = lines[-1]
        results[label] = summary
        for line in lines:  # each test by name (pytest -rA), so the run says which ran
            if line.startswith(("PASSED ", "FAILED ", "SKIPPED ", "ERROR ", "XFAIL ", "XPASS ")):
                print(f"    {line}", flush=True)
        print(f"  {label:<11} {summary}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if done.returncode not in (0, 5):  # 5: nothing collected
            print(done.stdout[-4000:] + done.stderr[-2000:], flush=True)
    return results


def run_compile_check() -> dict:
    """Every kernel compiled for sm_90 with Triton's ptxas (a dry run's stand-in for the device)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "strata.kernels.gpu.compile_check"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    print("\n".join("  " + line for line in done.stdout.splitlines()) + done.stderr[-2000:], flush=True)
    return {"ok": done.returncode == 0, "kernels": done.stdout.count("registers")}


# ----------------------------------------------------------------------------- kernels

L2_DEFEAT_BYTES = 256 * 2**20  # timed calls cycle over this many bytes of weights: 4x an H200's L2


def random_weight(qtype, rows: int, cols: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """uint8 (rows, row_bytes) of valid random blocks, on device."""
    from strata import quant
    from strata.synth import random_blocks

    q = quant.get(qtype)
    blocks = random_blocks(qtype, rows * cols // q.block_size, np.random.default_rng(seed))
    return torch.from_numpy(blocks.reshape(rows, -1)).to(device)


def copies(t: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """t and clones of it, together past the L2 cache, so each timed call reads DRAM."""
    n = 1 if device.type != "cuda" else max(1, -(-L2_DEFEAT_BYTES // t.numel()))
    return [t] + [t.clone() for _ in range(n - 1)]


def weights_of_each_type(types, rows: int, cols: int, device: torch.device, note: bool = True):
    """(qtype, copies of one random weight) per type, until the time budget is spent."""
    for qt in types:
        if out_of_time():
            if note:
                print("  (out of time: remaining types skipped)")
            return
        yield qt, copies(random_weight(qt, rows, cols, device), device)


def cycling(calls: list):
    """One function that makes the next of `calls` each time it is called."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


def bench_qmv(device: torch.device, shape: tuple[int, int], peak: float | None, types) -> list[dict]:
    from strata.kernels import gpu
    from strata.kernels.gpu import kernels
    from strata.formats.weights import QTensor

    rows, cols = shape
    x = torch.randn(1, cols, device=device)
    print(f"  x @ W.T, one row of x, W {rows} x {cols}:")
    print(f"  {'type':<8} {'MB':>8} {'us':>9} {'GB/s':>8} {'of peak':>8} {'torch us':>10} {'speed-up':>9} {'rel err':>9}")
    out = []
    for qt, raws in weights_of_each_type(types, rows, cols, device):
        t = seconds_per_call(cycling([partial(kernels.qmatmul, x, r, qt, shape) for r in raws]), device)
        ref = partial(gpu.qmatmul_reference, x, QTensor(raws[0], qt, shape))
        t_ref = seconds_per_call(ref, device, iters=5, reps=3)
        err = float((kernels.qmatmul(x, raws[0], qt, shape) - ref()).abs().max() / ref().abs().max())
        gbs = raws[0].numel() / t / 1e9
        row = {"type": qt.name, "mb": raws[0].numel() / 1e6, "us": t * 1e6, "gb_s": gbs,
               "of_peak": gbs * 1e9 / peak if peak else None, "torch_us": t_ref * 1e6, "rel_err": err}
        out.append(row)
        share = f"{row['of_peak']:.1%}" if peak else "-"
        print(f"  {qt.name:<8} {row['mb']:>8.1f} {row['us']:>9.1f} {gbs:>8.1f} {share:>8} "
              f"{row['torch_us']:>10.1f} {t_ref / t:>8.2f}x {err:>9.1e}" + ("  WRONG" if err > 1e-3 else ""),
              flush=True)
    return out


def bench_block_rows(device: torch.device, shape: tuple[int, int], types, choices=(4, 8, 16)) -> dict:
    """GB/s of the matrix-vector kernel per output-rows-per-program choice (8 is the default)."""
    from strata.kernels.gpu import kernels

    rows, cols = shape
    x = torch.randn(1, cols, device=device)
    out = {}
    for qt, raws in weights_of_each_type(types, rows, cols, device, note=False):
        out[qt.name] = {}
        for bn in choices:
            fn = cycling([partial(kernels.qmatmul, x, r, qt, shape, bn=bn) for r in raws])
            out[qt.name][bn] = raws[0].numel() / seconds_per_call(fn, device) / 1e9
        print(f"  {qt.name:<8} " + "  ".join(f"BN={bn}: {g:7.1f} GB/s" for bn, g in out[qt.name].items()), flush=True)
    return out


def expert_format_of(qtype, hidden: int, ffn: int):
    """An expert of one type throughout: gate and up (ffn, hidden), down (hidden, ffn)."""
    from strata import quant
    from strata.tiers.store import ExpertFormat, Part

    q = quant.get(qtype)
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    return ExpertFormat(tuple(Part(qtype, s, s[0] * s[1] // q.block_size * q.type_size, None) for s in shapes))


def random_slots(fmt, n: int, device: torch.device, distinct: int = 8) -> torch.Tensor:
    """uint8 (n, expert bytes): cache slots holding `distinct` random experts repeated (copies
    still occupy their own memory, which is what the timing needs)."""
    experts = torch.empty(distinct, fmt.nbytes, dtype=torch.uint8)
    for e in range(distinct):
        for i, (view, p) in enumerate(zip(fmt.split(experts[e]), fmt.parts)):
            view.copy_(random_weight(p.qtype, *p.shape, torch.device("cpu"), seed=3 * e + i).reshape(-1))
    experts = experts.to(device)
    return experts[torch.arange(n, device=device) % distinct]


def slot_parts(fmt, slots: torch.Tensor, e: int):
    return fmt.split(slots[e])


def routed_steps(n_experts: int, tokens: int, k: int, device: torch.device):
    """Router outputs for a run of steps that together touch every slot: (ids, weights, experts)."""
    per_step = min(n_experts, tokens * k)
    steps = []
    for start in range(0, n_experts - per_step + 1, per_step):
        g = torch.Generator().manual_seed(start)
        pool = torch.arange(start, start + per_step)
        ids = torch.stack([pool[torch.randperm(per_step, generator=g)[:k]] for _ in range(tokens)])
        steps.append((ids.to(device), torch.rand(tokens, k, generator=g).to(device), set(ids.unique().tolist())))
    return steps


def bench_grouped(device: torch.device, hidden: int, ffn: int, n_experts: int, batches, peak, types) -> list[dict]:
    """The grouped SwiGLU product over slots: GB/s of the distinct experts' bytes."""
    from strata.kernels import gpu
    from strata.kernels.grouped import grouped_swiglu as grouped_swiglu_reference, route_table

    print(f"  grouped SwiGLU over {n_experts} slots, experts {ffn} x {hidden} (gate, up) and {hidden} x {ffn} (down):")
    print(f"  {'type':<8} {'tokens':>6} {'experts':>7} {'MB':>7} {'us':>9} {'GB/s':>8} {'of peak':>8} "
          f"{'torch us':>10} {'speed-up':>9} {'rel err':>9}")
    out = []
    for qt in types:
        if out_of_time():
            print("  (out of time: remaining types skipped)")
            break
        fmt = expert_format_of(qt, hidden, ffn)
        parts = partial(slot_parts, fmt, random_slots(fmt, n_experts, device))
        for tokens, k in batches:
            x = torch.randn(tokens, hidden, device=device)
            source = lambda e: fmt.qtensors(parts(e))  # noqa: E731
            # the route tables on the host, as the tiers fill them from their one read back
            steps = [(x, route_table(ids.cpu(), w.cpu(), experts), source)
                     for ids, w, experts in routed_steps(n_experts, tokens, k, device)]
            refs = [(x, table.to(device), src) for x, table, src in steps]
            t = seconds_per_call(cycling([partial(gpu.grouped_swiglu, *a) for a in steps]), device)
            t_ref = seconds_per_call(cycling([partial(grouped_swiglu_reference, *a) for a in refs]),
                                     device, iters=5, reps=3)
            ref = grouped_swiglu_reference(*refs[0])
            err = float((gpu.grouped_swiglu(*steps[0]) - ref).abs().max() / ref.abs().max())
            n_used = len(set(steps[0][1].expert.tolist()))
            nbytes = n_used * fmt.nbytes
            gbs = nbytes / t / 1e9
            share = f"{gbs * 1e9 / peak:.1%}" if peak else "-"
            out.append({"type": qt.name, "tokens": tokens, "experts": n_used, "mb": nbytes / 1e6,
                        "us": t * 1e6, "gb_s": gbs, "torch_us": t_ref * 1e6, "rel_err": err})
            print(f"  {qt.name:<8} {tokens:>6} {n_used:>7} {nbytes / 1e6:>7.1f} {t * 1e6:>9.1f} {gbs:>8.1f} "
                  f"{share:>8} {t_ref * 1e6:>10.1f} {t_ref / t:>8.2f}x {err:>9.1e}" + ("  WRONG" if err > 1e-3 else ""),
                  flush=True)
    return out


def bench_prefill(device: torch.device, rows_x: int, shape: tuple[int, int], peak, types) -> list[dict]:
    """Prefill-sized x W^T three ways: the tiled Triton kernel from W's blocks (what a device `Linear`
    kept as blocks runs), dequantize + matmul per call (what it ran before), and cuBLAS on a bf16
    copy (what the plan's dequantize-at-placement gives): TFLOP/s, and the kernel's error."""
    from strata.kernels import gpu
    from strata.kernels.gpu import kernels
    from strata.formats.weights import QTensor

    rows, cols = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(rows_x, cols, device=device).to(dtype)
    flops = 2 * rows_x * rows * cols
    print(f"  x @ W.T, x {rows_x} x {cols} ({dtype}), W {rows} x {cols}:")
    print(f"  {'type':<8} {'blocks us':>10} {'TFLOP/s':>8} {'dequant+mm us':>14} {'bf16 copy us':>13} {'rel err':>9}")
    out = []
    for qt, raws in weights_of_each_type(types, rows, cols, device):
        w = QTensor(raws[0], qt, shape)
        t = seconds_per_call(cycling([partial(kernels.qmatmul_batched, x, r, qt, shape) for r in raws]), device)
        t_deq = seconds_per_call(partial(gpu.qmatmul_reference, x, w), device, iters=5, reps=3)
        dense = w.dequantize(dtype)
        t_bf16 = seconds_per_call(partial(torch.matmul, x, dense.T), device)
        ref = gpu.qmatmul_reference(x, w).float()
        err = float((kernels.qmatmul_batched(x, raws[0], qt, shape) - ref).abs().max() / ref.abs().max())
        row = {"type": qt.name, "us": t * 1e6, "tflop_s": flops / t / 1e12, "dequant_us": t_deq * 1e6,
               "bf16_us": t_bf16 * 1e6, "rel_err": err}
        out.append(row)
        print(f"  {qt.name:<8} {t * 1e6:>10.1f} {flops / t / 1e12:>8.2f} {t_deq * 1e6:>14.1f} {t_bf16 * 1e6:>13.1f} "
              f"{err:>9.1e}" + ("  WRONG" if err > 1e-2 else ""), flush=True)
    return out


# ----------------------------------------------------------------------------- decode


def decode_run(model: Path, prompt: list[int] | None, size: str, tokens: int, device: torch.device) -> dict:
    """Greedy decode with the expert cache at `size`: tokens/s and the tiers' hit rate."""
    import strata

    options = {"experts_cache": size, "pin_experts": "ram"}
    if device.type == "cuda":
        options["gpu_layers"] = "all"
    engine = strata.load(model, **options)
    ids = prompt or engine.tokenizer.encode(PROMPT)
    engine.generate(ids, 2, stop_at_eos=False)  # warm-up: compiles the kernels, fills the cache
    engine.generate(ids, tokens, stop_at_eos=False)
    stats = engine.stats
    engine.close()
    tiers = stats.get("tiers", {}).get("total", {})
    return {"tok_s": stats["decode_tokens_per_s"], "hit_rate": tiers.get("hit_rate", 0.0)}


def bench_decode(model: Path, sizes, tokens: int, device: torch.device, prompt=None) -> list[dict]:
    from strata.kernels import gpu

    print(f"  {model.name}, {tokens} tokens, greedy; device half by Triton vs by the torch reference:")
    print(f"  {'cache':>6} {'Triton tok/s':>13} {'torch tok/s':>12} {'ratio':>7} {'hit rate':>9}")
    out = []
    for size in sizes:
        if out_of_time():
            print("  (out of time: remaining sizes skipped)")
            break
        row = {"cache": size}
        for label, use in (("triton", True), ("torch", False)):
            gpu.USE_TRITON = use
            row[label] = decode_run(model, prompt, size, tokens, device)
        gpu.USE_TRITON = True
        out.append(row)
        t, r = row["triton"], row["torch"]
        print(f"  {size:>6} {t['tok_s']:>13.2f} {r['tok_s']:>12.2f} {t['tok_s'] / r['tok_s']:>6.2f}x "
              f"{t['hit_rate']:>9.1%}", flush=True)
    return out


# ----------------------------------------------------------------------------- decode at real shapes

ROWS_READ_ONCE = ("token_embd.weight", "per_layer_token_embd.weight")  # a step reads one row of each


def host_bandwidth() -> float:
    """RAM read bandwidth, bytes/s: a 512 MB copy on the CPU threads (median of 3): the CPU lane's limit."""
    a = torch.empty(2**27, dtype=torch.float32)
    b = torch.empty_like(a)
    a.fill_(1.0)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / statistics.median(times)  # read + write


def bytes_per_token(plan, config, hit_rate: float) -> tuple[int, int]:
    """(device bytes, host bytes) a decode token reads: the device's dense weights (one row of each
    table) and its share of the routed experts at this hit rate; the host reads the missed experts."""
    experts = {n for layer in plan.experts for n in layer.names}
    dense = sum(b for n, b in plan.sizes.items() if plan.homes[n] == "gpu" and n not in experts
                and n not in ROWS_READ_ONCE)
    routed = len(plan.experts) * getattr(config, "n_experts_used", 0) * plan.slot_bytes
    return int(dense + hit_rate * routed), int((1 - hit_rate) * routed)


def scale_model(out: Path, layers: int, experts: int, skew: float, dry_run: bool) -> Path:
    """A qwen4exp synth at the real model's shapes per tensor (IQ2_XS, as the flagship runs), with
    fewer experts per layer so the file is written and loaded inside the check's time."""
    from strata import synth

    path = out / f"qwen4exp-{layers}l-{experts}e-iq2_xs.gguf"
    if not path.exists():
        t0 = time.perf_counter()
        synth.write(path, "qwen4exp", layers=layers, quant_name="IQ2_XS", experts=experts,
                    vocab=4096 if dry_run else None, router_skew=skew)
        print(f"  wrote {path.name}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t0:.0f} s "
              f"(router skew {skew})", flush=True)
    return path


def bench_scale_decode(path: Path, sizes, tokens: int, device: torch.device, peak: float | None,
                       host_bw: float, dry_run: bool) -> list[dict]:
    """Decode tok/s with the expert cache at each size (100 % = every expert on the device), and the
    bandwidth limit for each: 1 / max(device bytes / device bandwidth, host bytes / RAM bandwidth)."""
    import strata
    from strata.kernels import gpu

    gpu.USE_TRITON = not dry_run  # the interpreter at real shapes would take hours; the dry run checks the flow
    print(f"  {path.name}, {tokens} tokens greedy; RAM {host_bw / 1e9:.1f} GB/s measured, device "
          f"{peak / 1e12 if peak else float('nan'):.2f} TB/s by name")
    print(f"  {'cache':>6} {'tok/s':>8} {'hit rate':>9} {'dev MB/tok':>11} {'host MB/tok':>12} {'limit tok/s':>12} "
          f"{'of limit':>9}")
    out = []
    for size in sizes:
        if out_of_time():
            print("  (out of time: remaining sizes skipped)")
            break
        options = {"experts_cache": size, "pin_experts": "ram", "gpu_layers": "all", "draft": "off",
                   "dtype": "bfloat16" if device.type == "cuda" else "float32"}
        engine = strata.load(path, **options)
        ids = list(range(10, 42))
        engine.generate(ids, 2, stop_at_eos=False)  # warm-up: compiles the kernels, fills the cache
        engine.generate(ids, tokens, stop_at_eos=False)
        stats, plan, config = engine.stats, engine.tiers.plan, engine.config
        engine.close()
        hit = 1.0 if size == "100%" else stats.get("tiers", {}).get("total", {}).get("hit_rate", 0.0)
        dev, host = bytes_per_token(plan, config, hit)
        seconds = max(dev / peak if peak else 0.0, host / host_bw)  # per token, at the slower of the two
        limit = 1 / seconds if seconds else float("nan")  # no device bandwidth known (a dry run): none
        tok_s = stats["decode_tokens_per_s"]
        row = {"cache": size, "tok_s": tok_s, "hit_rate": hit, "device_bytes": dev, "host_bytes": host,
               "limit_tok_s": limit, "share_of_limit": tok_s / limit}
        out.append(row)
        print(f"  {size:>6} {tok_s:>8.2f} {hit:>9.1%} {dev / 1e6:>11.1f} {host / 1e6:>12.1f} {limit:>12.1f} "
              f"{tok_s / limit:>8.1%}", flush=True)
    gpu.USE_TRITON = True
    return out


def bench_graphs_and_prefetch(path: Path, size: str, tokens: int, device: torch.device, dry_run: bool) -> dict:
    """One cache size, decode tok/s with CUDA graphs off and on (the dense segments between routing
    reads captured), and with prefetch off; whether the greedy tokens agree; the plan's dense forms.
    The dry run compiles with dynamo's eager backend (no capture on a CPU)."""
    import strata
    from strata.kernels import gpu
    from strata.kernels.gpu import graphs
    from strata.tiers.plan_cli import _dense_form_lines

    gpu.USE_TRITON = not dry_run
    base = {"experts_cache": size, "pin_experts": "ram", "gpu_layers": "all", "draft": "off",
            "dtype": "bfloat16" if device.type == "cuda" else "float32"}
    runs = {"graphs off": {"cuda_graphs": "off"}, "graphs on": {"cuda_graphs": "on" if not dry_run else "off"},
            "graphs on, prefetch off": {"cuda_graphs": "on" if not dry_run else "off", "prefetch": False}}
    ids = list(range(10, 42))
    out, tokens_of = {}, {}
    print(f"  {path.name}, cache {size}, {tokens} tokens greedy:")
    for label, extra in runs.items():
        if out_of_time():
            print("  (out of time: remaining runs skipped)")
            break
        engine = strata.load(path, **base, **extra)
        if dry_run and "graphs on" in label:
            graphs.enable(engine.model, torch.device("cpu"), backend="eager")
        if label == "graphs off":
            print("  " + "".join(_dense_form_lines(engine.tiers.plan)).strip(), flush=True)
        engine.generate(ids, 2, stop_at_eos=False)  # warm-up: compiles, captures, fills the cache
        tokens_of[label] = engine.generate(ids, tokens, stop_at_eos=False)
        stats = engine.stats
        compiled = isinstance(engine.model.forward, graphs.DecodeGraphs)
        engine.close()
        hit = stats.get("tiers", {}).get("total", {}).get("hit_rate", 0.0)
        out[label] = {"tok_s": stats["decode_tokens_per_s"], "hit_rate": hit, "compiled": compiled,
                      "same_tokens": tokens_of[label] == tokens_of["graphs off"]}
        print(f"  {label:<24} {stats['decode_tokens_per_s']:>8.2f} tok/s  hit rate {hit:6.1%}  compiled {compiled}  "
              f"tokens as graphs off: {out[label]['same_tokens']}", flush=True)
    gpu.USE_TRITON = True
    return out


# ----------------------------------------------------------------------------- main


def step(report: dict, key: str, title: str, fn, *args) -> None:
    """Run one step; a failure is printed and recorded, and the later steps still run."""
    print(f"\n{title}", flush=True)
    try:
        report[key] = fn(*args)
    except Exception as e:  # noqa: BLE001  (report it, go on: the session has one run of this script)
        traceback.print_exc()
        report[key] = f"error: {type(e).__name__}: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: Triton's interpreter on tiny shapes")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: compile (dry run only), kernels, "
                                               "decode, scale, tests")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--model", type=Path, default=DEMO, help="GGUF for the decode step (default: the demo model)")
    ap.add_argument("--out", type=Path, help="also write gpu_check.json here")
    ap.add_argument("--scale-layers", type=int, default=12, help="layers of the real-shape qwen4exp synth")
    ap.add_argument("--scale-experts", type=int, default=128,
                    help="experts per layer of that synth (the real model's 512 make a 9 GB file; 128 keep "
                         "every tensor's real shape and the check under 8 minutes)")
    ap.add_argument("--router-skew", type=float, default=1.0, help="the synth's routing skew (strata synth)")
    ap.add_argument("--synth-dir", type=Path, default=Path("/tmp/strata-gpu-check"),
                    help="where the synth is written (kept for a rerun)")
    args = ap.parse_args(argv)
    device = preflight(args.dry_run)
    skip = set(filter(None, args.skip.split(",")))
    from strata.kernels.gpu import KERNEL_TYPES
    from strata.quant import get

    name, peak, copy = peak_bandwidth(device)
    print(f"device: {name}; peak bandwidth {peak / 1e12 if peak else float('nan'):.2f} TB/s by name, "
          f"device-to-device copy {copy / 1e12 if copy else float('nan'):.2f} TB/s measured", flush=True)
    report = {"device": name, "peak_bytes_s": peak, "copy_bytes_s": copy}
    required = [get(t).ggml_type for t in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", "MXFP4", "IQ2_XXS", "IQ2_XS",
                                           "IQ3_XXS")]
    tiny = args.dry_run
    big = (48, 512) if tiny else (32768, 4096)  # one weight of 4096 x 32768: 34-142 MB
    hidden, ffn, n_slots = (256, 256, 4) if tiny else (2048, 768, 128)  # Qwen3-30B-A3B's experts
    batches = ((1, 2),) if tiny else ((1, 8), (4, 8))  # (tokens, experts per token)
    if tiny and "compile" not in skip:
        step(report, "compile", "0. compile for sm_90 (no GPU needed)", run_compile_check)
    if "kernels" not in skip:
        step(report, "qmv", "1. kernels", bench_qmv, device, big, peak, KERNEL_TYPES)
        if not tiny:
            step(report, "block_rows", "   output rows per program:", bench_block_rows, device, big,
                 [required[0], required[3], required[7]])
        step(report, "grouped", "   grouped expert product:", bench_grouped, device, hidden, ffn, n_slots, batches,
             peak, required[:2] if tiny else required)
        step(report, "prefill", "   prefill product from blocks (tiled Triton) vs dequantize per call vs a bf16 copy:",
             bench_prefill, device, 96 if tiny else 512, (64, 512) if tiny else (4096, 4096), peak,
             required[:2] if tiny else required)
    if "decode" not in skip:
        sizes, prompt = (("0", "100%"), [318, 288]) if tiny else (("0", "30%", "70%", "100%"), None)
        step(report, "decode", "2. decode", bench_decode, args.model, sizes, 2 if tiny else args.tokens, device,
             prompt)
    if "scale" not in skip:
        args.synth_dir.mkdir(parents=True, exist_ok=True)
        layers, experts = (2, 8) if tiny else (args.scale_layers, args.scale_experts)
        host_bw = host_bandwidth()
        report["host_bytes_s"] = host_bw
        step(report, "scale", "2b. decode, qwen4exp at real shapes: expert cache 30 % / 70 % vs all resident",
             lambda: bench_scale_decode(scale_model(args.synth_dir, layers, experts, args.router_skew, tiny),
                                        ("30%", "70%", "100%"), 2 if tiny else min(args.tokens, 32), device, peak,
                                        host_bw, tiny))
        step(report, "graphs", "2c. CUDA graphs off / on, and prefetch off, at 70 % cached",
             lambda: bench_graphs_and_prefetch(scale_model(args.synth_dir, layers, experts, args.router_skew, tiny),
                                               "70%", 2 if tiny else min(args.tokens, 32), device, tiny))
    if "tests" not in skip:
        step(report, "tests", "3. tests", run_tests)
    print(f"\ndone in {time.perf_counter() - START:.0f} s", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    return 1 if "error" in json.dumps(report, default=str).lower() or "failed" in json.dumps(report.get("tests")) \
        or not report.get("compile", {"ok": True})["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
