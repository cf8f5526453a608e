"""Decode speed of Strata against llama.cpp (through llama-cpp-python) on the same synthetic files.

    .venv/bin/python bench/bench_vs_llamacpp.py                 # Q4_K_M and IQ2_XS, 4 layers, 2 threads
    .venv/bin/python bench/bench_vs_llamacpp.py --quant Q4_K_M --tokens 32 --vocab 151936

Writes `strata synth --like qwen3-30b-a3b --layers 4` files (cached in --dir), then for each one
decodes --tokens tokens greedily after a short prompt in Strata and in llama.cpp, both on
--threads threads, and prints tokens/s and the ratio Strata / llama.cpp. Without
llama-cpp-python installed it says so and reports Strata alone.

The vocabulary is shrunk (--vocab, default 32768) because Strata keeps the embedding and the
output projection in float32; the per-layer shapes are the real ones.

On a machine whose cores are busy with other work, multi-threaded runs of both engines are
dominated by threads waiting at barriers for a descheduled peer (llama.cpp and torch both
spin-wait in OpenMP); compare with --threads 1 there, and look at the load average printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def strata_decode(path: Path, tokens: int, threads: int) -> float:
    import torch

    import strata

    torch.set_num_threads(threads)
    engine = strata.load(path, cpu_threads=threads)
    engine.generate(PROMPT, max_new_tokens=2, stop_at_eos=False)  # warm-up: page in, build kernels
    engine.generate(PROMPT, max_new_tokens=tokens, stop_at_eos=False)
    return engine.stats["decode_tokens_per_s"]


def llamacpp_decode(path: Path, tokens: int, threads: int) -> float | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(PROMPT) + tokens + 8, n_threads=threads,
                          n_threads_batch=threads, n_batch=64, verbose=False)
    for _ in range(2):  # the first pass pages the file in
        llm.reset()
        n, t_first = 0, None
        for _tok in llm.generate(PROMPT, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == 1:
                t_first = time.perf_counter()  # prompt done and first token out
            if n > tokens:
                break
        rate = tokens / (time.perf_counter() - t_first)
    return rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", nargs="*", default=["Q4_K_M", "IQ2_XS"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
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
          f"{args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    rows = []
    for quant in args.quant:
        path = synth_file(args.dir, quant, args.layers, args.vocab)
        s = strata_decode(path, args.tokens, args.threads)
        ll = llamacpp_decode(path, args.tokens, args.threads) if have_llama else None
        rows.append((quant, s, ll))
        ratio = f"{s / ll:.2f}" if ll else "n/a"
        print(f"  {quant:<7} strata {s:7.2f} tok/s   llama.cpp {f'{ll:7.2f} tok/s' if ll else '    n/a'}   "
              f"strata/llama.cpp {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
