"""`strata run`: one prompt, or an interactive chat when no prompt is given."""

from __future__ import annotations

import argparse
import json
import sys

from strata.argparser import ArgumentParser
from strata.errors import StrataError
from strata.tiers.expert_parallel.cli import add_parallel_args, parallel_options, worker_or_none
from strata.tiers.options import add_tier_args, tier_options


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags every command that loads a model shares (run, serve, bench)."""
    p.add_argument("--model", "-m", required=True, help="a .gguf file or a Hugging Face directory")
    p.add_argument("--ctx-size", type=int, default=0, help="context length (default: the model's)")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="tokens per prefill step")
    p.add_argument("--cpu-threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--exact-activations", action="store_true",
                   help="CPU kernels keep activations in float32 (the same as --activations float32)")
    p.add_argument("--activations", default="", choices=["q8x2", "q8c", "q8", "int16", "float32"],
                   help="how the CPU kernels quantize activations: q8x2 (default: two 8-bit passes, ~1e-4 from "
                        "exact), q8c (one 8-bit pass with a scale per 32 values: llama.cpp's accuracy class, "
                        "~20 %% faster decode on K-quant and IQ2 files), q8 (llama.cpp's own single pass)")
    p.add_argument("--draft", default="auto", choices=["on", "off", "auto"],
                   help="speculative decoding with the model's MTP layer (auto: on when it has one)")
    p.add_argument("--draft-tokens", type=int, default=2, help="tokens the MTP layer drafts per step")
    p.add_argument("--kv-device", metavar="SIZE", default=None,
                   help="tier the attention KV: at most SIZE (e.g. 64M) of KV blocks on the device, "
                        "the rest in host RAM")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                   help="capture a decode step's dense segments (between its routing reads and attention) "
                        "as CUDA graphs (auto: when the blocks run on CUDA)")
    add_tier_args(p)
    add_parallel_args(p)


def engine_options(args) -> dict:
    return dict(ctx_size=args.ctx_size, prefill_chunk=args.prefill_chunk,
                cpu_threads=args.cpu_threads, exact_activations=args.exact_activations,
                activations=getattr(args, "activations", ""),
                dtype=args.dtype, draft=args.draft,
                draft_tokens=args.draft_tokens, kv_device_budget=getattr(args, "kv_device", None),
                cuda_graphs=getattr(args, "cuda_graphs", "auto"),
                **tier_options(args), **parallel_options(args))


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="strata run", description="Generate text with a model.")
    add_engine_args(p)
    p.add_argument("--prompt", "-p", help="text to complete; without it, an interactive chat")
    p.add_argument("--file", "-f", help="read the prompt from this file (kept byte for byte)")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--max-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", "-t", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.max_tokens < 0:
        raise StrataError("--max-tokens must be >= 0")
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                args.prompt = f.read()
        except OSError as e:
            raise StrataError(f"cannot read --file {args.file}: {e.strerror}") from None
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repetition_penalty=args.repeat_penalty, seed=args.seed)
    from strata.runtime.sampling import SamplingParams

    SamplingParams(**sampling)  # a bad value is refused (BadOption) before the model loads
    worker = worker_or_none(args, engine_options(args))  # --expert-parallel: ranks > 0 serve their share
    if worker is not None:
        return worker
    import strata

    engine = strata.load(args.model, progress=True, **engine_options(args))
    print(engine.summary(), file=sys.stderr)
    if engine.tokenizer is None:
        raise StrataError(f"{args.model} has no tokenizer", "use a GGUF with tokenizer metadata")
    if args.prompt is None:
        try:
            return chat(engine, args, sampling)
        finally:
            _close(engine)
    text = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids = engine.tokenizer.encode(text, add_special_tokens=not args.chat)
    out_ids, pieces = [], []
    for r in engine.stream(ids, args.max_tokens, stop=args.stop, **sampling):
        if r.token is not None:
            out_ids.append(r.token)
        pieces.append(r.text)
        if not args.json:
            print(r.text, end="", flush=True)
    _close(engine)
    stats = dict(engine.stats)
    if args.json:
        print(json.dumps({"text": "".join(pieces), "token_ids": out_ids, "stats": stats}))
    else:
        print(f"\n\n[{stats['completion_tokens']} tokens, {stats['decode_tokens_per_s']:.1f} tok/s decode, "
              f"{stats['prefill_tokens_per_s']:.1f} tok/s prefill, peak RSS {stats['peak_rss_mb']:.0f} MB]",
              file=sys.stderr)
        if "draft" in stats:
            d = stats["draft"]
            print(f"[draft: {d['accepted']}/{d['drafted']} accepted ({100 * d['acceptance_rate']:.0f}%), "
                  f"{d['tokens_per_round']:.2f} tokens per verify pass]", file=sys.stderr)
        if "ngram_table" in stats:
            t = stats["ngram_table"]
            print(f"[n-gram table: {t['table_bytes'] / 2**20:.1f} MiB on disk, never loaded; "
                  f"{t['bytes_read_per_token']:.0f} bytes read per token ({t['rows_read_per_token']:.2f} rows of "
                  f"{t['row_bytes']} B; {t['rows_requested'] / max(t['tokens'], 1):.0f} looked up, the rest from "
                  f"a RAM row cache), {1e3 * t['read_s_per_token']:.3f} ms reading per token]", file=sys.stderr)
        if "expert_parallel" in stats.get("tiers", {}):
            from strata.tiers.expert_parallel.cli import describe_stats

            print(describe_stats(stats["tiers"]), file=sys.stderr)
        elif "tiers" in stats:
            from strata.tiers.stats import describe

            print(describe(stats["tiers"]), file=sys.stderr)
    return 0


def _close(engine) -> None:
    """Stop the tiers and write the expert trace (--trace-experts), saying where."""
    path = engine.close() if hasattr(engine, "close") else None
    if path:
        print(f"[expert trace written to {path}]", file=sys.stderr)


def chat(engine, args, sampling) -> int:
    messages = []
    print("strata chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        reply = []
        for r in engine.stream(ids, args.max_tokens, stop=args.stop, **sampling):
            print(r.text, end="", flush=True)
            reply.append(r.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
