"""SSD-homed experts vs all experts in RAM, side by side in one run.

    .venv/bin/python bench/bench_ssd_home.py [--model M.gguf] [--ratio 2.5] [--tokens 32]

Without --model it writes a random-weight qwen3moe GGUF (8 layers x 32 experts, top-4,
Q8_0 experts) to a temporary directory. The SSD run gets a RAM cache of expert bytes / ratio,
reads experts with O_DIRECT (or pread + DONTNEED), so every miss is a real read, not a page-cache
hit. Prints decode tokens/s and bytes read per decoded token for both runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import gguf
import torch

import strata
from strata.gguf.writer import write_gguf
from strata.formats import qwen3moe
from strata.formats.hparams import RopeConfig
from strata.tiers.sizes import format_size

Q8_0, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32


def random_model(path: Path, hidden=768, ffn=384, layers=8, experts=32, top_k=4, vocab=512) -> Path:
    c = qwen3moe.Config(vocab_size=vocab, hidden_size=hidden, n_layers=layers, n_heads=8, n_kv_heads=4,
                        head_dim=hidden // 8, ffn_size=0, expert_ffn_size=ffn, n_experts=experts,
                        n_experts_used=top_k, norm_topk_prob=True, rms_eps=1e-6,
                        rope=RopeConfig(dim=hidden // 8, theta=10000.0), context_length=1024)
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def tensors():
        yield "token_embd.weight", r(vocab, hidden), F32
        yield "output_norm.weight", 1 + 0.1 * r(hidden), F32
        for i in range(layers):
            p, hd = f"blk.{i}", c.head_dim
            for name, shape in (("attn_q", (8 * hd, hidden)), ("attn_k", (4 * hd, hidden)),
                                ("attn_v", (4 * hd, hidden)), ("attn_output", (hidden, 8 * hd))):
                yield f"{p}.{name}.weight", r(*shape), F32
            for name, n in (("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", hd), ("attn_k_norm", hd)):
                yield f"{p}.{name}.weight", 1 + 0.1 * r(n), F32
            yield f"{p}.ffn_gate_inp.weight", r(experts, hidden), F32
            for name, shape in (("gate", (experts, ffn, hidden)), ("up", (experts, ffn, hidden)),
                                ("down", (experts, hidden, ffn))):
                yield f"{p}.ffn_{name}_exps.weight", r(*shape), Q8_0

    return write_gguf(path, qwen3moe.ARCH, qwen3moe.gguf_metadata(c), tensors())


def run(path: Path, prompt: list[int], n_tokens: int, **options) -> dict:
    """Prefill, then time the decode alone; bytes read are counted over the decode only."""
    engine = strata.load(path, **options)
    disk = _disk_home(engine)
    read0, t_first, done = 0, None, 0
    t0 = time.perf_counter()
    for _ in _tokens(engine, prompt, n_tokens):
        done += 1
        if t_first is None:
            t_first, read0 = time.perf_counter(), disk.reader.bytes_read if disk else 0
    end = time.perf_counter()
    decoded = max(done - 1, 1)
    read = (disk.reader.bytes_read - read0) if disk else 0
    stats = engine.stats.get("tiers", {})
    engine.close()
    return {"decode_tok_s": decoded / (end - t_first), "prefill_s": t_first - t0,
            "bytes_per_token": read / decoded, "hit_rate": stats.get("total", {}).get("hit_rate", 0.0),
            "ram_cache_hit_rate": disk.hits / max(disk.hits + disk.misses, 1) if disk else None}


def _tokens(engine, prompt, n):
    from strata.runtime.generate import generate_step
    from strata.runtime.sampling import SamplingParams

    steps = generate_step(engine.model, [prompt], SamplingParams(temperature=0.0), engine.model.new_cache(1))
    for _ in range(n):
        yield next(steps)
    steps.close()


def _disk_home(engine):
    if engine.tiers is None:
        return None
    return next((h for h in engine.tiers.homes.values() if h.kind == "disk"), None)


def _best(a: dict | None, b: dict) -> dict:
    return b if a is None or b["decode_tok_s"] > a["decode_tok_s"] else a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a MoE GGUF (default: write a random one)")
    p.add_argument("--ratio", type=float, default=2.5, help="expert bytes / RAM cache")
    p.add_argument("--tokens", type=int, default=32, help="tokens to decode")
    p.add_argument("--threads", type=int, default=0, help="--cpu-threads for both runs")
    p.add_argument("--repeat", type=int, default=2, help="alternate the runs this often, keep each one's best")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_model(Path(tmp) / "random-moe.gguf")
        _report(path, args)


def _report(path: Path, args) -> None:
    probe = strata.load(path, experts_cache="0")
    expert_bytes = probe.tiers.plan.expert_bytes()
    vocab = probe.config.vocab_size
    probe.close()
    prompt = torch.randint(0, vocab, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    ram_cache = int(expert_bytes / args.ratio)
    common = dict(experts_cache="0", cpu_threads=args.threads, prefetch=False)
    ram = ssd = None
    for _ in range(max(args.repeat, 1)):  # alternate, so drift in machine load hits both alike
        ram = _best(ram, run(path, prompt, args.tokens, pin_experts="ram", **common))
        ssd = _best(ssd, run(path, prompt, args.tokens, pin_experts="disk", ram_cache=str(ram_cache), **common))
    if args.json:
        print(json.dumps({"expert_bytes": expert_bytes, "ram_cache": ram_cache, "ram": ram, "ssd": ssd}))
        return
    print(f"model {path}: experts {format_size(expert_bytes)}, SSD run's RAM cache {format_size(ram_cache)} "
          f"(experts are {args.ratio}x the cache), {args.tokens} tokens decoded, greedy, "
          f"best of {args.repeat}\n")
    print(f"{'':<24} {'all in RAM':>14} {'SSD home':>14} {'SSD / RAM':>10}")
    print(f"{'decode tokens/s':<24} {ram['decode_tok_s']:>14.2f} {ssd['decode_tok_s']:>14.2f} "
          f"{ssd['decode_tok_s'] / ram['decode_tok_s']:>10.2f}")
    print(f"{'bytes read per token':<24} {format_size(ram['bytes_per_token']):>14} "
          f"{format_size(ssd['bytes_per_token']):>14}")
    print(f"{'RAM cache hit rate':<24} {'-':>14} {ssd['ram_cache_hit_rate']:>14.1%}")
    print(f"{'prefill seconds':<24} {ram['prefill_s']:>14.2f} {ssd['prefill_s']:>14.2f}")


if __name__ == "__main__":
    main()
