"""`strata bench`: cold start, serial warm, concurrency, long output and prefill, in one report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata.argparser import ArgumentParser
from strata.bench import machine, regimes, report
from strata.runtime.run_cli import add_engine_args, engine_options

PROMPT = 'import os\n\n\ndef read_config(path):\n    """Read a JSON config file and return a dict."""\n'


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="strata bench", description=__doc__)
    add_engine_args(p)
    p.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, bench.png")
    p.add_argument("--runs", type=int, default=9, help="serial warm runs (the report used 9)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per serial run (the report used 256)")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--prefill", default="512,4096,32768", help="prompt lengths for prefill speed")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 serial runs, short outputs")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.quick:
        args.runs, args.tokens, args.long_tokens, args.concurrency, args.prefill = 2, 16, 64, "1,2", "64"
    options = engine_options(args)
    if options["expert_parallel"]:  # its cold-start regime starts fresh single processes
        from strata.errors import BadOption

        raise BadOption("strata bench does not run under --expert-parallel",
                        "use bench/bench_expert_parallel.py, which launches the ranks itself")
    import strata

    result = {"model": args.model, "flags": ["strata", "bench", *argv], "machine": machine.describe()}
    result["cold_start"] = [regimes.cold_start(args.model, options, PROMPT, state) for state in ("dropped", "warm")]
    engine = strata.load(args.model, **options)
    ids = engine.tokenizer.encode(PROMPT)
    _progress("serial warm")
    result["serial_warm"] = regimes.serial_warm(engine, ids, args.runs, args.tokens)
    _progress("concurrency")
    prompts = [engine.tokenizer.encode(PROMPT + f"\n# variant {i}\n") for i in range(8)]
    levels = [int(x) for x in args.concurrency.split(",")]
    result["concurrency"] = regimes.concurrency(engine, prompts, levels, args.tokens)
    _progress("long output")
    result["long_output"] = regimes.long_output(engine, ids, args.long_tokens, window=max(args.long_tokens // 8, 8))
    _progress("prefill")
    result["prefill"] = regimes.prefill_speed(engine, ids, [int(x) for x in args.prefill.split(",")])
    paths = report.write(result, Path(args.out))
    print(report.markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _progress(name: str) -> None:
    print(f"strata bench: {name} ...", file=sys.stderr, flush=True)
