"""Real scale: the full-size flagship from disk under a RAM budget, each figure beside its limit.

    .venv/bin/python bench/bench_scale.py --model big/qwen4exp-48L-IQ2_XS.gguf \
        --ram-memory 9G [--tokens 12] [--prompt-tokens 32] \
        [--skewed-model big/qwen4exp-48L-IQ2_XS-skew0.2.gguf --skew 0.2]
    .venv/bin/python bench/bench_scale.py --model big/qwen3next-80b-48L-Q4_K_M-skew0.3.gguf \
        --ram-memory 9G --llama-cpp --skew 0.3

The file is `strata synth --like qwen4exp --layers 48 --quant IQ2_XS` (45.7 GiB, written once).
Every run is a fresh interpreter with the placement `--pin-experts auto --experts-cache auto`
(what `strata run` chooses by itself) and `--ram-memory`; this process samples its anonymous RSS
(`RssAnon`) every 20 ms. Measured in the same run:

  * disk bandwidth, four ways: a probe just before and one just after the engine runs, each read
    the way the disk home reads (random experts of this file, each its three byte ranges read
    straight into a reused buffer by strata's FileReader, O_DIRECT, as many in flight as the home
    has readers), and the run's own expert reads in prefill and in decode: the bytes the disk
    moved over the time at least one read was in flight. A shared disk swings (0.3-1.1 GB/s here
    from one minute to the next), so the limits use the best of the four: decode's bytes over its
    wall time can never beat them over its busier time, so decode / disk limit is at most 100 %;
  * memory bandwidth: a 512 MiB copy (read + write counted).

A second prompt of as many other tokens then runs in the same process and decodes as many tokens:
what a running server's next request gets. The RAM cache's memory is populated once per process
(`strata.tiers.arena`), which a virtual machine whose host takes back free guest memory backs again
page by page (0.6-3.7 s a GiB here): not during a prompt, which then reuses the buffers populated so
far, but during the first decode, which pays for it (a smaller cache, and the populating CPU) where
the second request's decode does not; so the table prints both decodes.

Limits printed beside the figures: decode tok/s if every byte the decode read from disk came at
that bandwidth (`disk limit`), time to first token if the bytes that must be read before
it (the dense weights the forward uses, and the experts the prompt used: not the reads ahead it
left unused, shown apart) came at that bandwidth, peak anonymous RSS against `--ram-memory` (the
interpreter's own, measured before loading, shown apart).

For the comparison where the experts exceed RAM, the qwen3-next-80b file must be larger than the
machine's RAM (`--quant Q4_K_M` at 48 layers: 45.1 GiB; the IQ2_XS one, 21.9 GiB, fits a 23 GiB page
cache, so llama.cpp's mapping ends up serving it from RAM): the table prints the file's size beside
the machine's RAM. `--llama-cpp` runs llama.cpp (llama-cpp-python: mmap with no weight repacking (`use_extra_bufts` off:
its CPU_REPACK copies every Q4_K tensor into anonymous memory first, 35.5 GB for the 45.1 GiB file,
which fails on a 23 GiB machine), the same threads, greedy, the same prompt
ids) on each file after Strata, and prints its decode and prefill beside Strata's with the ratios
(for `--like qwen3-next-80b`, or any file llama.cpp loads: llama-cpp-python 0.3.36 runs qwen4exp too). Each engine starts from a
cold file: the bench drops the file's page-cache pages (posix_fadvise, this file only) first.

`--skewed-model FILE --skew S` adds a run of a second file, the same synth written with
`--router-skew S` (the skew is only a label here). Otherwise the bench never writes to a model file.

`--write-in-turn 0,0.3` (with `--like`, `--layers`, `--quant`) is for a disk that holds one full-size
file at a time: for each skew in turn the bench deletes `--model`, writes it again with `strata synth
--like L --layers N --quant Q --router-skew S` (the same seeded weights: only the routers' row scales
differ), measures the disk on it and runs it; the last one stays. One invocation prints the columns side
by side, each with its own disk bandwidth.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from strata.tiers.budget import AnonPeak  # noqa: E402
from strata.tiers.store import READERS, FileReader  # noqa: E402
from strata.tiers.sizes import format_size, parse_size  # noqa: E402

CHILD = textwrap.dedent("""
    import json, sys, time
    t_start = time.perf_counter()
    import strata  # first, as `strata run` does: it sets torch's OpenMP wait policy before torch loads
    import torch
    import strata.runtime.engine, strata.tiers.runtime, strata.kernels
    from strata.tiers.budget import anon_rss
    strata.kernels.available()
    path, options, n_prompt, n_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    base = anon_rss()
    t0 = time.perf_counter()
    engine = strata.load(path, **options)
    load_s = time.perf_counter() - t0
    homes = [h for h in {id(h): h for h in engine.tiers.homes.values()}.values() if h.kind == "disk"]
    readers = list({id(h.reader): h.reader for h in homes}.values())
    def counters():
        return (sum(h.reader.bytes_read for h in homes), sum(h.hits for h in homes), sum(h.misses for h in homes),
                sum(h.wait_s for h in homes), sum(h.read_ahead for h in homes), sum(h.ahead_used for h in homes),
                sum(h.used_bytes for h in homes), sum(r.device_bytes for r in readers), sum(r.busy_s for r in readers))
    ids = [(7 * i + 3) % engine.config.vocab_size for i in range(n_prompt)]
    t1, cpu_t1 = time.perf_counter(), time.process_time()
    first = None
    out = []
    for r in engine.stream(ids, n_new, stop_at_eos=False):
        if r.token is None:
            continue
        out.append(r.token)
        if first is None:
            first, at_first, cpu_first = time.perf_counter(), counters(), time.process_time()
    end, at_end, cpu_end = time.perf_counter(), counters(), time.process_time()
    d = [b - a for a, b in zip(at_first, at_end)]
    # a second prompt in the same process (other tokens), to its first token: the RAM cache's pages
    # are written by now, so its reads land in memory the process already has
    ids2 = [(11 * i + 5003) % engine.config.vocab_size for i in range(n_prompt)]
    t2, c2 = time.perf_counter(), counters()
    out2 = []
    for r in engine.stream(ids2, n_new, stop_at_eos=False):
        if r.token is None:
            continue
        out2.append(r.token)
        if len(out2) == 1:
            second = [b - a for a, b in zip(c2, counters())]
            second_s = time.perf_counter() - t2
            t3, c3 = time.perf_counter(), counters()
    end2, d2 = time.perf_counter(), [b - a for a, b in zip(c3, counters())]
    n_dec2 = max(len(out2) - 1, 1)
    n_dec = max(len(out) - 1, 1)
    homes_stats = engine.tiers.stats()["homes"]
    print(json.dumps({
        "base": base, "load_s": load_s, "prefill_s": first - t1, "ttft_s": first - t0,
        "prefill_tok_s": n_prompt / (first - t1), "decode_tok_s": (len(out) - 1) / (end - first),
        "prefill_bytes": at_first[0], "prefill_used_bytes": at_first[6], "prefill_wait_s": at_first[3],
        "prefill_read_ahead": at_first[4], "prefill_ahead_used": at_first[5],
        "dense_read": engine.tiers.readahead.total if engine.tiers.readahead is not None else None,
        "decode_bytes_per_token": d[0] / n_dec, "decode_device_bytes": d[7], "decode_busy_s": d[8],
        "decode_s": end - first, "prefill_device_bytes": at_first[7], "prefill_busy_s": at_first[8],
        "decode_hit_rate": d[1] / max(d[1] + d[2] + d[5], 1), "decode_ahead_rate": d[5] / max(d[1] + d[2] + d[5], 1),
        "decode_wait_s_per_token": d[3] / n_dec, "decode_cpu_s_per_token": (cpu_end - cpu_first) / n_dec, "prefill_cpu_s": cpu_first - cpu_t1, "read_ahead_per_token": d[4] / n_dec,
        "ahead_used_per_token": d[5] / n_dec, "memory": engine.memory.as_dict(), "ctx": engine.ctx_size,
        "max_in_flight": max((h.get("max_reads_in_flight", 0) for h in homes_stats), default=0),
        "second_ttft_s": second_s, "second_used_bytes": second[6], "second_device_bytes": second[7],
        "second_busy_s": second[8], "second_decode_tok_s": (len(out2) - 1) / (end2 - t3),
        "second_decode_device_bytes_per_token": d2[7] / n_dec2,
        "second_decode_hit_rate": d2[1] / max(d2[1] + d2[2] + d2[5], 1),
        "summary": engine.summary(), "tokens": out}))
""")


LLAMA_CHILD = textwrap.dedent("""
    import json, sys, time
    t_start = time.perf_counter()
    import llama_cpp
    import llama_cpp.llama_cpp as capi
    defaults = capi.llama_model_default_params
    def no_repack():  # weights stay in the mapping: a repack copies them all into anonymous memory first
        params = defaults()
        params.use_extra_bufts = False
        return params
    capi.llama_model_default_params = no_repack
    path, threads, n_prompt, n_new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=n_prompt + n_new + 16, n_threads=threads, n_threads_batch=threads,
                          use_mmap=True, verbose=False)
    load_s = time.perf_counter() - t0
    ids = [(7 * i + 3) % llm.n_vocab() for i in range(n_prompt)]
    out, first = [], None
    t1 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if first is None:
            first = time.perf_counter()
        if len(out) >= n_new:
            break
    end = time.perf_counter()
    print(json.dumps({"load_s": load_s, "ttft_s": first - t0, "prefill_tok_s": n_prompt / (first - t1),
                      "decode_tok_s": (len(out) - 1) / (end - first), "tokens": out}))
""")


def drop_cached(path: Path) -> None:
    """Drop this file's pages from the page cache (posix_fadvise DONTNEED: this file only), so
    each engine starts from a cold file, as after a reboot, whatever ran or wrote it before."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _run_child(script: str, args: list[str], what: str) -> dict:
    """Run `script` in a fresh interpreter on a cold file (args[0]), watching its peak anonymous
    RSS; its last stdout line is its JSON result."""
    drop_cached(Path(args[0]))
    proc = subprocess.Popen([sys.executable, "-c", script, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = AnonPeak(proc.pid, 0.02)
    out, err = proc.communicate()
    peak = watch.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (rc {proc.returncode}): {err[-3000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    r["peak_anon"] = peak
    return r


def run_llama_cpp(path: Path, threads: int, n_prompt: int, n_new: int) -> dict:
    """llama.cpp (llama-cpp-python) on the same file: mmap, the same threads, greedy, the same prompt ids."""
    return _run_child(LLAMA_CHILD, [str(path), str(threads), str(n_prompt), str(n_new)], "llama.cpp run")


def expert_spans(path: Path) -> list[list[tuple[int, int]]]:
    """Every routed expert's (gate, up, down) byte ranges in the file, as the disk home reads them."""
    reader = GGUFReader(path)
    by_layer: dict[str, dict[str, object]] = {}
    for t in reader.tensors:
        for part in ("gate", "up", "down"):
            if t.name.endswith(f".ffn_{part}_exps.weight"):
                by_layer.setdefault(t.name.split(".")[1], {})[part] = t
    out = []
    for parts in by_layer.values():
        if len(parts) != 3:
            continue
        ts = [parts[p] for p in ("gate", "up", "down")]
        n = int(ts[0].shape[-1])
        out += [[(int(t.data_offset) + e * (int(t.n_bytes) // n), int(t.n_bytes) // n) for t in ts] for e in range(n)]
    return out


def disk_bandwidth(path: Path, seconds: float = 3.0, in_flight: int = READERS, spans=None) -> dict:
    """The disk read the way the disk home reads it: random experts' three byte ranges (`spans`,
    from `expert_spans`), each expert read straight into a reused page-aligned buffer by strata's
    own FileReader (O_DIRECT), `in_flight` readers at once. Without expert tensors: 2 MiB reads at
    random offsets. Returns bytes/s over the probe (device bytes, alignment included) and how."""
    reader = FileReader(path)
    size = path.stat().st_size
    stop = time.perf_counter() + seconds

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        buf = None
        while time.perf_counter() < stop:
            if spans:
                expert = spans[rng.randrange(len(spans))]
            else:
                expert = [(rng.randrange(0, size - (2 << 20)), 2 << 20)]
            need = reader.direct_bytes(expert)
            if buf is None or buf.numel() < need:
                buf = torch.empty(need, dtype=torch.uint8)
            reader.read_spans(expert, buf)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(worker, range(in_flight)))
    elapsed = time.perf_counter() - t0
    reader.close()
    what = (f"random experts' 3 ranges ({sum(n for _, n in spans[0]) / 2**20:.2f} MiB an expert)" if spans
            else "2 MiB at random offsets")
    return {"bw": reader.device_bytes / elapsed, "reads": reader.reads, "s": elapsed,
            "how": f"{what}, {in_flight} in flight, {'O_DIRECT' if reader.direct else 'buffered + DONTNEED'}"}


def achieved(r: dict, phase: str) -> float:
    """Bytes/s the run's own expert reads got in `phase` (decode or prefill): device bytes over the
    time at least one read was in flight (0 when nothing was read)."""
    busy = r.get(f"{phase}_busy_s", 0.0)
    return r.get(f"{phase}_device_bytes", 0) / busy if busy > 0 else 0.0


def own(r: dict, phase: str) -> str:
    """The run's reads in `phase`, as printed."""
    return (f"{r.get(f'{phase}_device_bytes', 0) / 2**30:.2f} GiB in {r.get(f'{phase}_busy_s', 0.0):.2f} s with a read "
            f"in flight = {achieved(r, phase) / 1e9:.2f} GB/s")


def disk_limit(r: dict) -> tuple[float, str]:
    """The disk bandwidth the limits use: the best of the probes before and after the run and what the
    run's own reads got while in flight in prefill and in decode. Decode's bytes over decode's wall
    time can never beat its bytes over the (shorter) time a read was in flight, so decode / disk limit
    is at most 100 % by construction; a probe that reads the disk low cannot make it more."""
    seen = {"probe before": r["disk_before"], "probe after": r["disk_after"],
            "prefill's reads": achieved(r, "prefill"), "decode's reads": achieved(r, "decode")}
    best = max(seen, key=seen.get)
    return seen[best], best


def prefill_disk(r: dict) -> float:
    """The disk's rate while the prompt ran: the better of the probe just before it and the prefill's own
    reads while in flight. The disk swings from one minute to the next, and decode's reads (later) can
    find it faster: beside the strict limit (the best of the four), this says how near the prefill came
    to what the disk gave it then; the probe keeps a read pattern slower than the disk's from counting."""
    return max(r["disk_before"], achieved(r, "prefill"))


def memory_bandwidth(nbytes: int = 512 << 20, repeats: int = 3) -> float:
    """Bytes/s moved by a large copy (read + write), best of `repeats`."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, 2 * nbytes / (time.perf_counter() - t0))
    return best


def run(path: Path, ram: str, threads: int, n_prompt: int, n_new: int) -> dict:
    opts = {"ram_memory": ram, "pin_experts": "auto", "experts_cache": "auto", "cpu_threads": threads}
    return _run_child(CHILD, [str(path), json.dumps(opts), str(n_prompt), str(n_new)], "run")


def _agree(a: list[int], b: list[int]) -> str:
    """How many leading tokens two engines' greedy outputs share, of how many."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{min(len(a), len(b))}"


def skews(text: str) -> list[float]:
    """`--write-in-turn 0,0.3` -> [0.0, 0.3]."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of --router-skew values "
                                         "(e.g. 0,0.3)") from None


def _synth_name(path: Path) -> str | None:
    """The file's general.name when it is a GGUF, else None."""
    try:
        field = GGUFReader(path).get_field("general.name")
        return None if field is None else field.contents()
    except Exception:  # noqa: BLE001 -- not a GGUF, or unreadable: not a file strata synth wrote
        return None


def write_synth(path: Path, like: str, layers: int, quant: str, skew: float) -> str:
    """`strata synth` (a subprocess, as a user runs it) writes `path` afresh; returns its report. A file
    there that strata synth did not write (its general.name is not synth-...) is never deleted."""
    if path.exists():
        name = _synth_name(path)
        if not (name or "").startswith("synth-"):
            raise SystemExit(f"--write-in-turn would delete {path}, which strata synth did not write "
                             f"(general.name {name!r}): give --model a new path")
        path.unlink()
    cmd = [sys.executable, "-m", "strata.cli", "synth", str(path), "--like", like, "--layers", str(layers),
           "--quant", quant, "--router-skew", f"{skew:g}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"strata synth failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return " ".join(line.strip() for line in proc.stdout.splitlines() if line.startswith(("wrote", "  router skew")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ram-memory", default="9G")
    ap.add_argument("--tokens", type=int, default=12, help="tokens to generate per run")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skewed-model", help="also run this file: the same synth written with --router-skew")
    ap.add_argument("--skew", type=float, default=0.0, help="the --router-skew the skewed file (or, without --skewed-model, --model) was written with")
    ap.add_argument("--write-in-turn", metavar="S,S,...", type=skews,
                    help="write --model with strata synth for each of these --router-skew values in turn and run each")
    ap.add_argument("--like", default="qwen4exp", help="with --write-in-turn: strata synth --like")
    ap.add_argument("--layers", type=int, default=48, help="with --write-in-turn: strata synth --layers")
    ap.add_argument("--quant", default="IQ2_XS", help="with --write-in-turn: strata synth --quant")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also run llama.cpp (llama-cpp-python, mmap, same threads) on each file")
    args = ap.parse_args(argv)
    path = Path(args.model)
    budget = parse_size(args.ram_memory, "--ram-memory")
    in_turn = args.write_in_turn
    if in_turn and args.skewed_model:
        raise SystemExit("--write-in-turn writes --model for each skew: leave out --skewed-model")
    print(f"# load average {os.getloadavg()[0]:.2f} (shared machine: 2 cores, other engineers' jobs running)")
    mem = memory_bandwidth()
    print("# each engine starts from a cold file: its page-cache pages are dropped before the run "
          "(posix_fadvise DONTNEED, this file only)")
    print(f"# memory {mem / 1e9:.1f} GB/s (512 MiB copy); disk: probed before and after each run as the disk home "
          f"reads it (random experts, {READERS} in flight, O_DIRECT), and the run's own reads over the time one "
          "was in flight")
    if in_turn:
        print(f"# one file on disk at a time: {path.name} is written by strata synth --like {args.like} --layers "
              f"{args.layers} --quant {args.quant} --router-skew S for each S in turn, then run")
    rows = []
    # without --skewed-model, --skew labels --model itself (a file written with --router-skew, run alone
    # when disk holds one full-size file at a time)
    runs = [(path, s) for s in in_turn] if in_turn else [(path, 0.0 if args.skewed_model else args.skew)] + \
        ([(Path(args.skewed_model), args.skew)] if args.skewed_model else [])
    for model, skew in runs:
        if in_turn:
            t0 = time.perf_counter()
            report = write_synth(model, args.like, args.layers, args.quant, skew)
            print(f"# {report} (bench: {time.perf_counter() - t0:.0f} s)", flush=True)
        spans = expert_spans(model)
        before = disk_bandwidth(model, spans=spans)
        print(f"# {model.name} (router skew {skew:g}): {format_size(model.stat().st_size)}; disk before the run "
              f"{before['bw'] / 1e9:.2f} GB/s ({before['how']}: {before['reads']} reads in {before['s']:.1f} s); "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        r = run(model, args.ram_memory, args.threads, args.prompt_tokens, args.tokens)
        r["load_avg"] = os.getloadavg()[0]
        after = disk_bandwidth(model, spans=spans)
        print(f"# disk after the run {after['bw'] / 1e9:.2f} GB/s ({after['how']}: {after['reads']} reads in "
              f"{after['s']:.1f} s); load average {os.getloadavg()[0]:.2f}", flush=True)
        r["skew"], r["disk_before"], r["disk_after"] = skew, before["bw"], after["bw"]
        r["file_size"] = model.stat().st_size
        r["disk"], r["disk_from"] = disk_limit(r)
        print(f"# the run's own reads: decode {own(r, 'decode')}; prefill {own(r, 'prefill')}; the limits use "
              f"{r['disk'] / 1e9:.2f} GB/s, the best of the four ({r['disk_from']})", flush=True)
        if args.llama_cpp:
            r["llama"] = run_llama_cpp(model, args.threads, args.prompt_tokens, args.tokens)
            print(f"# llama.cpp on {model.name}: {json.dumps({k: v for k, v in r['llama'].items() if k != 'tokens'})}",
                  flush=True)
        rows.append(r)
        print(f"# run {model.name} (router skew {skew:g}): {r['summary']}", flush=True)
        print(f"# greedy tokens: {r['tokens']}", flush=True)
    dense = rows[0]["memory"]["dense"]

    def dense_of(r):  # the dense weights the first forward reads (read ahead: all but the embedding's rows)
        return r["dense_read"] if r.get("dense_read") is not None else r["memory"]["dense"]

    def must_read(r):  # bytes that must come from disk before the first token
        return dense_of(r) + r["prefill_used_bytes"]
    def dev_per_token(r):  # bytes the disk moved per decoded token (alignment included)
        return r["decode_device_bytes"] / max(len(r["tokens"]) - 1, 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    table = [("router skew", lambda r: f"{r['skew']:g}"),
             (f"model file GiB (machine RAM {ram / 2**30:.1f} GiB)", lambda r: f"{r['file_size'] / 2**30:.2f}"),
             ("disk GB/s: probe before / after the run (expert reads, 8 in flight)",
              lambda r: f"{r['disk_before'] / 1e9:.2f} / {r['disk_after'] / 1e9:.2f}"),
             ("  the run's reads while in flight: prefill / decode GB/s",
              lambda r: f"{achieved(r, 'prefill') / 1e9:.2f} / {achieved(r, 'decode') / 1e9:.2f}"),
             ("  disk GB/s the limits use (the best of the four)", lambda r: f"{r['disk'] / 1e9:.2f}"),
             ("load average at the end of the run", lambda r: f"{r['load_avg']:.1f}"),
             ("load s", lambda r: f"{r['load_s']:.1f}"),
             ("time to first token s", lambda r: f"{r['ttft_s']:.1f}"),
             ("  limit: (dense + experts the prompt used) / disk s", lambda r: f"{must_read(r) / r['disk']:.1f}"),
             ("  time to first token / limit", lambda r: f"{r['ttft_s'] * r['disk'] / must_read(r):.2f}x"),
             ("  the same at the disk's rate during the prefill (probe before, prefill's reads: the better)",
              lambda r: f"{r['ttft_s'] * prefill_disk(r) / must_read(r):.2f}x"),
             ("  GiB read before it (dense, experts used, read ahead unused)",
              lambda r: f"{dense_of(r) / 2**30:.2f}, {r['prefill_used_bytes'] / 2**30:.2f}, "
                        f"{(r['prefill_bytes'] - r['prefill_used_bytes']) / 2**30:.2f}"),
             ("  prefill: reads started ahead (used)",
              lambda r: f"{r.get('prefill_read_ahead', 0)} ({r.get('prefill_ahead_used', 0)})"),
             ("  prefill: time waiting for reads s (all workers)", lambda r: f"{r['prefill_wait_s']:.2f}"),
             ("second prompt in the process: time to first token s", lambda r: f"{r['second_ttft_s']:.1f}"),
             ("  limit: experts it used / disk s (dense weights read already)",
              lambda r: f"{r['second_used_bytes'] / r['disk']:.1f}"),
             ("  its time to first token / limit", lambda r: f"{r['second_ttft_s'] * r['disk'] / max(r['second_used_bytes'], 1):.2f}x"),
             ("  its reads while in flight GB/s",
              lambda r: f"{r['second_device_bytes'] / max(r['second_busy_s'], 1e-9) / 1e9:.2f}"),
             ("  then its decode tok/s (the RAM cache populated by now)", lambda r: f"{r['second_decode_tok_s']:.3f}"),
             ("    its decode / disk limit",
              lambda r: f"{r['second_decode_tok_s'] * r['second_decode_device_bytes_per_token'] / r['disk']:.0%}"),
             ("    its RAM-cache hit rate", lambda r: f"{r['second_decode_hit_rate']:.1%}"),
             (f"prefill tok/s ({args.prompt_tokens} tokens)", lambda r: f"{r['prefill_tok_s']:.2f}"),
             ("  prefill CPU time s (all threads)", lambda r: f"{r['prefill_cpu_s']:.2f}"),
             (f"decode tok/s ({args.tokens} tokens)", lambda r: f"{r['decode_tok_s']:.3f}"),
             ("  disk limit: disk bw / bytes read per token",
              lambda r: f"{r['disk'] / max(dev_per_token(r), 1):.3f}"),
             ("  decode / disk limit", lambda r: f"{r['decode_tok_s'] * dev_per_token(r) / r['disk']:.0%}"),
             ("  limit with dense weights at memory bw", lambda r: f"{1 / (dev_per_token(r) / r['disk'] + dense / mem):.3f}"),
             ("disk MiB read per decoded token", lambda r: f"{r['decode_bytes_per_token'] / 2**20:.0f}"),
             ("RAM-cache hit rate (decode)", lambda r: f"{r['decode_hit_rate']:.1%}"),
             ("  uses served by a read ahead", lambda r: f"{r['decode_ahead_rate']:.1%}"),
             ("reads started ahead per token (used)",
              lambda r: f"{r['read_ahead_per_token']:.0f} ({r['ahead_used_per_token']:.0f})"),
             ("most reads in flight", lambda r: f"{r['max_in_flight']}"),
             ("time waiting for reads per token s", lambda r: f"{r['decode_wait_s_per_token']:.2f}"),
             ("decode CPU time per token s (all threads)", lambda r: f"{r['decode_cpu_s_per_token']:.2f}"),
             (f"  CPU limit: {args.threads} cores / CPU time tok/s",
              lambda r: f"{args.threads / max(r['decode_cpu_s_per_token'], 1e-9):.3f}"),
             ("context chosen", lambda r: f"{r['ctx']}"),
             ("peak anonymous RSS GiB", lambda r: f"{r['peak_anon'] / 2**30:.2f}"),
             ("  of which interpreter + libraries GiB", lambda r: f"{r['base'] / 2**30:.2f}"),
             ("  --ram-memory GiB (+5 %)", lambda r: f"{budget / 2**30:.2f} ({1.05 * budget / 2**30:.2f})"),
             ("  planned GiB", lambda r: f"{r['memory']['total'] / 2**30:.2f}")]
    if args.llama_cpp:
        table += [(f"llama.cpp decode tok/s (mmap, {args.threads} threads)", lambda r: f"{r['llama']['decode_tok_s']:.3f}"),
                  ("  Strata / llama.cpp decode", lambda r: f"{r['decode_tok_s'] / r['llama']['decode_tok_s']:.2f}"),
                  ("llama.cpp time to first token s", lambda r: f"{r['llama']['ttft_s']:.1f}"),
                  ("llama.cpp prefill tok/s", lambda r: f"{r['llama']['prefill_tok_s']:.2f}"),
                  ("  Strata / llama.cpp prefill", lambda r: f"{r['prefill_tok_s'] / r['llama']['prefill_tok_s']:.2f}"),
                  ("llama.cpp peak anonymous RSS GiB", lambda r: f"{r['llama']['peak_anon'] / 2**30:.2f}"),
                  ("greedy tokens equal to Strata's", lambda r: f"{_agree(r['tokens'], r['llama']['tokens'])}")]
    width = max(len(name) for name, _ in table)
    print()
    for name, cell in table:
        print(f"{name:<{width}}  " + "  ".join(f"{cell(r):>12}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
