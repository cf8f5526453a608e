"""The prepared GPU check: kernel tests on CUDA, each Triton kernel's GB/s, tiered decode speed.

    python bench/gpu_check.py [--out DIR] [--skip tests,kernels,decode] [--tokens 64]
    python bench/gpu_check.py --dry-run    # on a CPU: the same steps, Triton's interpreter, tiny shapes,
                                           # and every kernel compiled for sm_90 (~5 minutes on 2 cores)

Sized for a session lent one GPU for 15 minutes in all (an H200): under 8 minutes.
1. tests: tests/test_triton_kernels.py (compiled on the device) and every gpu-marked test.
2. kernels: per ggml type, `x @ W.T` over a weight larger than L2 (one row of x), and the
   grouped SwiGLU product over cache slots at Qwen3-30B-A3B's expert size (a decode step's 8
   experts; 4 tokens' 32): achieved GB/s of weight bytes against the device's peak bandwidth
   (by its name) and a measured device-to-device copy, next to the torch reference path.
3. decode: the demo model with the expert cache at 0, 30, 70 and 100 %: tokens/s and hit
   rates, with the device half computed by Triton and by the torch reference, side by side.
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
import json
import os
import statistics
import subprocess
import sys
import time
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


# ----------------------------------------------------------------------------- 1. tests


def run_tests(dry_run: bool) -> dict:
    gpu_marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                        if "mark.gpu" in p.read_text() and p.name != "test_triton_kernels.py")
    runs = {"triton": ["tests/test_triton_kernels.py"], "gpu-marked": [*gpu_marked, "-m", "gpu"]}
    results = {}
    for label, args in runs.items():
        if out_of_time():
            results[label] = "skipped: out of time"
            continue
        t0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tests choose
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        results[label] = summary
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


# ----------------------------------------------------------------------------- 2. kernels


def random_weight(qtype, rows: int, cols: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """uint8 (rows, row_bytes) of valid random blocks, on device."""
    from strata import quant
    from strata.synth import random_blocks

    q = quant.get(qtype)
    blocks = random_blocks(qtype, rows * cols // q.block_size, np.random.default_rng(seed))
    return torch.from_numpy(blocks.reshape(rows, -1)).to(device)


def bench_qmv(device: torch.device, shape: tuple[int, int], peak: float | None, types) -> list[dict]:
    from strata.kernels import gpu
    from strata.kernels.gpu import kernels
    from strata.models.weights import QTensor

    rows, cols = shape
    x = torch.randn(1, cols, device=device)
    print(f"  x @ W.T, one row of x, W {rows} x {cols}:")
    print(f"  {'type':<8} {'MB':>8} {'us':>9} {'GB/s':>8} {'of peak':>8} {'torch us':>10} {'speed-up':>9}")
    out = []
    for qt in types:
        if out_of_time():
            print("  (out of time: remaining types skipped)")
            break
        raw = random_weight(qt, rows, cols, device)
        t = seconds_per_call(partial(kernels.qmatmul, x, raw, qt, shape), device)
        t_ref = seconds_per_call(partial(gpu.qmatmul_reference, x, QTensor(raw, qt, shape)), device, iters=5, reps=3)
        gbs = raw.numel() / t / 1e9
        row = {"type": qt.name, "mb": raw.numel() / 1e6, "us": t * 1e6, "gb_s": gbs,
               "of_peak": gbs * 1e9 / peak if peak else None, "torch_us": t_ref * 1e6}
        out.append(row)
        share = f"{row['of_peak']:.1%}" if peak else "-"
        print(f"  {qt.name:<8} {row['mb']:>8.1f} {row['us']:>9.1f} {gbs:>8.1f} {share:>8} "
              f"{row['torch_us']:>10.1f} {t_ref / t:>8.2f}x", flush=True)
    return out


def bench_block_rows(device: torch.device, shape: tuple[int, int], types, choices=(4, 8, 16)) -> dict:
    """GB/s of the matrix-vector kernel per output-rows-per-program choice (8 is the default)."""
    from strata.kernels.gpu import kernels

    rows, cols = shape
    x = torch.randn(1, cols, device=device)
    out = {}
    for qt in types:
        if out_of_time():
            break
        raw = random_weight(qt, rows, cols, device)
        out[qt.name] = {bn: raw.numel() / seconds_per_call(partial(kernels.qmatmul, x, raw, qt, shape, bn=bn),
                                                           device) / 1e9 for bn in choices}
        print(f"  {qt.name:<8} " + "  ".join(f"BN={bn}: {g:7.1f} GB/s" for bn, g in out[qt.name].items()), flush=True)
    return out


def expert_format_of(qtype, hidden: int, ffn: int):
    """An expert of one type throughout: gate and up (ffn, hidden), down (hidden, ffn)."""
    from strata import quant
    from strata.tiers.store import ExpertFormat, Part

    q = quant.get(qtype)
    shapes = ((ffn, hidden), (ffn, hidden), (hidden, ffn))
    return ExpertFormat(tuple(Part(qtype, s, s[0] * s[1] // q.block_size * q.type_size, None) for s in shapes))


def random_slots(fmt, n: int, device: torch.device) -> torch.Tensor:
    """uint8 (n, expert bytes): cache slots holding n random experts, as the device cache lays them out."""
    slots = torch.empty(n, fmt.nbytes, dtype=torch.uint8)
    for e in range(n):
        for i, (view, p) in enumerate(zip(fmt.split(slots[e]), fmt.parts)):
            view.copy_(random_weight(p.qtype, *p.shape, torch.device("cpu"), seed=3 * e + i).reshape(-1))
    return slots.to(device)


def slot_parts(fmt, slots: torch.Tensor, e: int):
    return fmt.split(slots[e])


def bench_grouped(device: torch.device, hidden: int, ffn: int, n_experts: int, batches, peak, types) -> list[dict]:
    """The grouped SwiGLU product over slots: GB/s of the distinct experts' bytes."""
    from strata.kernels import gpu

    print(f"  grouped SwiGLU over {n_experts} slots, experts {ffn} x {hidden} (gate, up) and {hidden} x {ffn} (down):")
    print(f"  {'type':<8} {'tokens':>6} {'experts':>7} {'MB':>7} {'us':>9} {'GB/s':>8} {'of peak':>8} "
          f"{'torch us':>10} {'speed-up':>9}")
    out = []
    for qt in types:
        if out_of_time():
            print("  (out of time: remaining types skipped)")
            break
        fmt = expert_format_of(qt, hidden, ffn)
        slots = random_slots(fmt, n_experts, device)
        parts = partial(slot_parts, fmt, slots)
        for tokens, k in batches:
            g = torch.Generator().manual_seed(tokens)
            ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)]).to(device)
            weights = torch.rand(tokens, k, generator=g).to(device)
            experts = set(ids.unique().tolist())
            x = torch.randn(tokens, hidden, device=device)
            args = (x, ids, weights, experts, fmt, parts)
            t = seconds_per_call(partial(gpu.expert_product, *args), device)
            t_ref = seconds_per_call(partial(gpu.expert_product_reference, *args), device, iters=5, reps=3)
            nbytes = len(experts) * fmt.nbytes
            gbs = nbytes / t / 1e9
            share = f"{gbs * 1e9 / peak:.1%}" if peak else "-"
            out.append({"type": qt.name, "tokens": tokens, "experts": len(experts), "mb": nbytes / 1e6,
                        "us": t * 1e6, "gb_s": gbs, "torch_us": t_ref * 1e6})
            print(f"  {qt.name:<8} {tokens:>6} {len(experts):>7} {nbytes / 1e6:>7.1f} {t * 1e6:>9.1f} {gbs:>8.1f} "
                  f"{share:>8} {t_ref * 1e6:>10.1f} {t_ref / t:>8.2f}x", flush=True)
    return out


# ----------------------------------------------------------------------------- 3. decode


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


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: Triton's interpreter on tiny shapes")
    ap.add_argument("--skip", default="", help="comma-separated steps to skip: compile (dry run only), tests, "
                                               "kernels, decode")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    ap.add_argument("--model", type=Path, default=DEMO, help="GGUF for the decode step (default: the demo model)")
    ap.add_argument("--out", type=Path, help="also write gpu_check.json here")
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
    if args.dry_run and "compile" not in skip:
        print("\n0. compile for sm_90 (no GPU needed)", flush=True)
        report["compile"] = run_compile_check()
    if "tests" not in skip:
        print("\n1. tests", flush=True)
        report["tests"] = run_tests(args.dry_run)
    if "kernels" not in skip:
        print("\n2. kernels", flush=True)
        big = (48, 512) if tiny else (32768, 4096)  # 4096 x 32768 weights: 40-140 MB, past the L2
        report["qmv"] = bench_qmv(device, big, peak, KERNEL_TYPES)
        if not tiny:
            print("  output rows per program:")
            report["block_rows"] = bench_block_rows(device, big, required[:1] + required[3:4] + required[7:8])
        hidden, ffn, n = (256, 256, 4) if tiny else (2048, 768, 64)
        batches = ((1, 2),) if tiny else ((1, 8), (4, 8))
        report["grouped"] = bench_grouped(device, hidden, ffn, n, batches, peak, required[:2] if tiny else required)
    if "decode" not in skip:
        print("\n3. decode", flush=True)
        sizes, prompt = (("0", "100%"), [318, 288]) if tiny else (("0", "30%", "70%", "100%"), None)
        report["decode"] = bench_decode(args.model, sizes, 2 if tiny else args.tokens, device, prompt)
    print(f"\ndone in {time.perf_counter() - START:.0f} s", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    failed = any("failed" in str(v) or "error" in str(v) for v in report.get("tests", {}).values())
    return 1 if failed or not report.get("compile", {"ok": True})["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
