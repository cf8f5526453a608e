"""Decode speed of Strata against llama.cpp (through llama-cpp-python) on the same synthetic files.

    .venv/bin/python bench/bench_vs_llamacpp.py                 # Q4_K_M and IQ2_XS, 4 layers, 2 threads
    .venv/bin/python bench/bench_vs_llamacpp.py --quant Q4_K_M --tokens 32 --vocab 151936
    .venv/bin/python bench/bench_vs_llamacpp.py --threads 1 --profile   # + where a decode step goes

Writes `strata synth --like qwen3-30b-a3b --layers 4` files (cached in --dir), then for each one
decodes --tokens tokens greedily after a short prompt in Strata and in llama.cpp, both on
--threads threads, and prints tokens/s and the ratio Strata / llama.cpp. Without
llama-cpp-python installed it says so and reports Strata alone.

The vocabulary is shrunk (--vocab, default 32768) to keep the files small; the per-layer shapes
are the real ones.

Each rate is given twice: by wall-clock time and by the process's CPU time (tokens per CPU
second, both engines measured the same way). On a machine shared with other work the wall
rate swings with the load; at 1 thread the CPU-time rate is the steadier comparison.

`--profile` adds, for Strata, a per-kernel profile of decode steps (torch.profiler, with each
quantized matrix product labelled by type and shape, and the model's parts labelled by what
they do) and the bytes of weights one decode token reads against the machine's memory
bandwidth (a large tensor copy), i.e. the floor on time per token.

On a machine whose cores are busy with other work, multi-threaded runs of both engines are
dominated by threads waiting at barriers for a descheduled peer (llama.cpp and torch both
spin-wait in OpenMP); compare with --threads 1 there, and look at the load average printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPT = [300, 301, 302, 303, 304, 305, 306, 307]


def synth_file(directory: Path, quant: str, layers: int, vocab: int) -> Path:
    from strata import synth

    path = directory / f"synth-qwen3-30b-a3b-{layers}L-{quant}-v{vocab}.gguf"
    if not path.exists():
        t = time.perf_counter()
        tmp = path.with_suffix(".part")
        synth.write(tmp, "qwen3-30b-a3b", layers, quant, vocab)
        tmp.rename(path)
        print(f"  wrote {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s")
    return path


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _rates(tokens: int, start: tuple[float, float]) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process) since `start`."""
    wall, cpu = _clocks()
    return tokens / (wall - start[0]), tokens / max(cpu - start[1], 1e-9)


def strata_load(path: Path, threads: int):
    import torch

    import strata

    torch.set_num_threads(threads)
    engine = strata.load(path, cpu_threads=threads)
    engine.generate(PROMPT, max_new_tokens=2, stop_at_eos=False)  # warm-up: page in, build kernels
    return engine


def strata_decode(engine, tokens: int) -> tuple[float, float]:
    """Decode rates of `tokens` greedy tokens after the prompt (prefill and first token excluded)."""
    import torch

    from strata.runtime.generate import generate_step
    from strata.runtime.sampling import SamplingParams

    model = engine.model
    steps = generate_step(model, [PROMPT], SamplingParams(), model.new_cache(1))
    with torch.inference_mode():
        next(steps)  # prompt done and first token out
        start = _clocks()
        for _ in range(tokens):
            next(steps)
    return _rates(tokens, start)


def llamacpp_decode(path: Path, tokens: int, threads: int) -> tuple[float, float] | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(PROMPT) + tokens + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=64, verbose=False)
    for _ in range(2):  # the first pass pages the file in
        llm.reset()
        start = None
        for n, _tok in enumerate(llm.generate(PROMPT, temp=0.0, top_k=1, reset=True), start=1):
            if n == 1:
                start = _clocks()  # prompt done and first token out
            if n > tokens:
                break
        rates = _rates(tokens, start)
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", nargs="*", default=["Q4_K_M", "IQ2_XS"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each engine; medians are printed")
    ap.add_argument("--profile", action="store_true", help="also profile Strata's decode steps")
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "strata-bench")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        import llama_cpp

        have_llama = f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        have_llama = None
        print("llama.cpp is unavailable (pip install llama-cpp-python, or a wheel from /work/wheels); "
              "measuring Strata alone")
    print(f"qwen3-30b-a3b shapes, {args.layers} layers, vocab {args.vocab}, {args.tokens} decoded tokens, "
          f"{args.threads} threads, median of {args.repeats} runs, load average {os.getloadavg()[0]:.1f}")
    print(f"  {'quant':<7} {'tok/s by':<8} {'strata':>8} {'llama.cpp':>10} {'ratio':>6}")
    for quant in args.quant:
        path = synth_file(args.dir, quant, args.layers, args.vocab)
        engine = strata_load(path, args.threads)
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate, so both see the same background load
            ours.append(strata_decode(engine, args.tokens))
            if have_llama:
                theirs.append(llamacpp_decode(path, args.tokens, args.threads))
        for i, clock in enumerate(("wall", "CPU")):
            s = statistics.median(r[i] for r in ours)
            ll = statistics.median(r[i] for r in theirs) if theirs else None
            print(f"  {quant:<7} {clock:<8} {s:8.2f} {f'{ll:10.2f}' if ll else '       n/a'} "
                  f"{f'{s / ll:6.2f}' if ll else '   n/a'}", flush=True)
        if args.profile:
            from decode_profile import print_profile

            print_profile(engine, PROMPT, args.tokens)
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
