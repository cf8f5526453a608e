"""The PLE n-gram table read from disk: bytes read per token and the time the reads add to a step.

    .venv/bin/python bench/bench_ngram_table.py [--table-mb 256] [--prompt 256] [--tokens 64] [--keep DIR]

Writes a random-weight qwen4exp GGUF (tiny trunk: hidden 256, 8 layers, 8 experts; PLE on layer 1
with 16 hash heads of 128-value F16 rows, the released model's row shape) whose n-gram table is
--table-mb large, then, with the table's pages dropped from the page cache (posix_fadvise
DONTNEED) before each cold phase:

  prefill   one prompt: all its rows requested at once, read on the pool while layer 0 runs
  decode    --tokens greedy steps: each token's 16 rows, read from a cold page cache
  replay    the same tokens again on a fresh model cache: every row is an LRU hit (no reads),
            so the step time difference is what the reads cost

and prints, per token: rows and bytes read by the reader, the kernel's view (/proc/self/io rchar:
bytes asked of read(); read_bytes: bytes fetched from the device, page-granular), time inside
pread (overlapped with compute) and time the forward waited for the rows. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import gguf
import torch

import strata
from strata.gguf.writer import write_gguf
from strata.formats import qwen4exp
from strata.formats.ngram_hash import TABLE, NgramHash, head_vocab_sizes, layer_multipliers
from strata.formats.hparams import RopeConfig

F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32


def config(table_mb: int, vocab=4096, hidden=256, layers=8, row_dim=128, per_ngram=8, ngram=3) -> qwen4exp.Config:
    heads = (ngram - 1) * per_ngram
    rows_per_head = table_mb * 2**20 // (heads * row_dim * 2)
    sizes = head_vocab_sizes(rows_per_head - 64, heads, 0)
    h = NgramHash(ngram, per_ngram, tuple(layer_multipliers(vocab, ngram, 0, 1234)), tuple(sizes),
                  tuple(sum(sizes[:i]) for i in range(heads)), eos=2)
    recurrent = tuple((i + 1) % 4 != 0 for i in range(layers))
    return qwen4exp.Config(
        vocab_size=vocab, hidden_size=hidden, n_layers=layers, n_heads=4, n_kv_heads=2, head_dim=64,
        expert_ffn_size=128, shared_ffn_size=128, n_experts=8, n_experts_used=2, norm_topk_prob=True, rms_eps=1e-6,
        rope=RopeConfig(dim=16, theta=1e6), rope_sections=(11, 11, 10, 0), context_length=4096, recurrent=recurrent,
        conv_kernel=4, linear_k_heads=2, linear_v_heads=4, linear_k_dim=32, linear_v_dim=32, gate_act="sigmoid",
        hc_count=4, hc_rank=32, indexer_heads=4, indexer_dim=32, indexer_budget=64,
        compress_ratios=tuple(0 if r else 4 for r in recurrent), ple_layers=(1,), ple_conv_kernel=4,
        ple_row_dim=row_dim, ple_hash=h)


def random_gguf(path: Path, c: qwen4exp.Config) -> Path:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    h, w, rank = c.hidden_size, c.hc_count * c.hidden_size, c.hc_rank
    t = {"token_embd.weight": r(c.vocab_size, h), "output.weight": r(c.vocab_size, h),
         "output_hc_norm.weight": norm(w), "output_hc_down.weight": r(rank, w), "output_hc_up.weight": r(w, rank)}
    key_dim, v_dim = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim
    for i in range(c.n_layers):
        p = f"blk.{i}."
        for kind in ("attn", "ffn"):
            t.update({f"{p}hc_{kind}_norm.weight": norm(w), f"{p}hc_{kind}_down.weight": r(rank, w),
                      f"{p}hc_{kind}_up.weight": r(w, rank), f"{p}hc_{kind}_inject.weight": r(c.hc_count, w)})
        if c.recurrent[i]:
            nv = c.linear_v_heads
            t.update({f"{p}attn_qkv.weight": r(2 * key_dim + v_dim, h), f"{p}attn_gate.weight": r(v_dim, h),
                      f"{p}ssm_beta.weight": r(nv, h), f"{p}ssm_alpha.weight": r(nv, h),
                      f"{p}ssm_conv1d.weight": r(2 * key_dim + v_dim, c.conv_kernel),
                      f"{p}ssm_dt.bias": 0.1 * torch.randn(nv, generator=g), f"{p}ssm_a": -torch.rand(nv, generator=g),
                      f"{p}ssm_norm.weight": norm(c.linear_v_dim), f"{p}ssm_out.weight": r(h, v_dim)})
        else:
            hd, ih, idim = c.head_dim, c.indexer_heads, c.indexer_dim
            t.update({f"{p}attn_q.weight": r(2 * c.n_heads * hd, h), f"{p}attn_k.weight": r(c.n_kv_heads * hd, h),
                      f"{p}attn_v.weight": r(c.n_kv_heads * hd, h), f"{p}attn_output.weight": r(h, c.n_heads * hd),
                      f"{p}attn_q_norm.weight": norm(hd), f"{p}attn_k_norm.weight": norm(hd),
                      f"{p}indexer.q_proj.weight": r(ih * idim, h), f"{p}indexer.k_proj.weight": r(idim, h),
                      f"{p}indexer.q_norm.weight": norm(idim), f"{p}indexer.k_norm.weight": norm(idim)})
        if i in c.ple_layers:
            e = c.ple_embed_dim
            t.update({f"{p}ple_key.weight": r(w, e), f"{p}ple_value.weight": r(h, e),
                      f"{p}ple_norm_key.weight": norm(w), f"{p}ple_norm_query.weight": norm(w),
                      f"{p}ple_norm_conv.weight": norm(w), f"{p}ple_conv1d.weight": r(w, c.ple_conv_kernel)})
        ne, f, s = c.n_experts, c.expert_ffn_size, c.shared_ffn_size
        t.update({f"{p}ffn_gate_inp.weight": r(ne, h), f"{p}ffn_gate_exps.weight": r(ne, f, h),
                  f"{p}ffn_up_exps.weight": r(ne, f, h), f"{p}ffn_down_exps.weight": r(ne, h, f),
                  f"{p}ffn_gate_shexp.weight": r(s, h), f"{p}ffn_up_shexp.weight": r(s, h),
                  f"{p}ffn_down_shexp.weight": r(h, s), f"{p}ffn_gate_inp_shexp.weight": r(1, h)})
    rows = -(-c.ple_hash.min_rows // 128) * 128
    tensors = [(name, x, F32) for name, x in t.items()]
    tensors.append((TABLE, torch.randn(rows, c.ple_row_dim, generator=g).to(torch.float16), F16))
    return write_gguf(path, qwen4exp.ARCH, qwen4exp.gguf_metadata(c), tensors)


def kernel_io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def phase(table, fn):
    """Run fn() with the table's counters reset; return its stats and the kernel's io delta."""
    table.reset_stats()
    before = kernel_io()
    out = fn()
    after = kernel_io()
    s = table.stats()
    s["kernel_rchar"] = after["rchar"] - before["rchar"]
    s["kernel_read_bytes"] = after["read_bytes"] - before["read_bytes"]
    return s, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table-mb", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="prompts (cold decode + replay each); medians shown")
    ap.add_argument("--keep", type=Path, help="write the GGUF here (and reuse it if present)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    workdir = args.keep or Path(tempfile.mkdtemp(prefix="ngram-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"qwen4exp-table{args.table_mb}.gguf"
    c = config(args.table_mb)
    if not path.exists():
        t0 = time.perf_counter()
        random_gguf(path, c)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f}s")
    engine = strata.load(path)
    model, table = engine.model, engine.model.ple_table
    print(f"table: {table.rows} rows x {table.row_bytes} B = {table.rows * table.row_bytes / 2**20:.0f} MiB; "
          f"{c.ple_hash.n_heads} rows per token; LRU {table.cache_bytes >> 20} MiB; "
          f"read at load: {table.stats()['bytes_read']} B")

    g = torch.Generator().manual_seed(1)
    runs = {"prefill": [], "decode_cold": [], "decode_lru_hits": []}
    steps = {"decode_cold": [], "decode_lru_hits": []}
    with torch.inference_mode():
        model(torch.randint(3, c.vocab_size, (1, 8), generator=g), model.new_cache(1))  # warm-up

        def decode(cache, first, tokens=None):
            times, seq, tok = [], [], first
            for i in range(args.tokens):
                if tokens is not None:
                    tok = tokens[i]
                t0 = time.perf_counter()
                logits = model(tok, cache, last_only=True)
                times.append(time.perf_counter() - t0)
                seq.append(tok)
                tok = logits[:, 0].argmax(-1, keepdim=True)
            return times, seq

        for _ in range(args.repeats):  # a new prompt each time, so its n-grams are new rows
            prompt = torch.randint(3, c.vocab_size, (1, args.prompt), generator=g)
            table.drop_cache()
            cache = model.new_cache(1)

            def prefill():
                t0 = time.perf_counter()
                logits = model(prompt, cache, last_only=True)
                return time.perf_counter() - t0, logits[:, 0].argmax(-1, keepdim=True)

            s, (prefill_s, tok) = phase(table, prefill)
            runs["prefill"].append(dict(s, seconds=prefill_s))
            table.drop_cache(rows=False)  # cold pages; the LRU keeps the prompt's rows
            s, (times, seq) = phase(table, lambda: decode(cache, tok))
            runs["decode_cold"].append(s)
            steps["decode_cold"] += times
            replay = model.new_cache(1)  # the same tokens again: every row is an LRU hit, nothing is read
            model(prompt, replay, last_only=True)
            s, (times, _) = phase(table, lambda: decode(replay, None, seq))
            runs["decode_lru_hits"].append(s)
            steps["decode_lru_hits"] += times
    results = {k: {f: statistics.median(r[f] for r in v) for f in v[0] if isinstance(v[0][f], (int, float))}
               for k, v in runs.items()}
    for k, v in steps.items():
        results[k]["step_s"] = statistics.median(v)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    p = results["prefill"]
    print(f"\nmedians of {args.repeats} runs")
    print(f"prefill {args.prompt} tokens: {p['seconds'] * 1e3:.0f} ms; rows read {p['rows_read']} "
          f"({p['rows_read_per_token']:.1f}/token, {p['cache_hits']} LRU hits), "
          f"{p['bytes_read'] / 2**10:.0f} KiB ({p['bytes_read_per_token']:.0f} B/token) in {p['read_calls']} preads; "
          f"kernel rchar {p['kernel_rchar'] / 2**10:.0f} KiB, "
          f"device read_bytes {p['kernel_read_bytes'] / 2**10:.0f} KiB; "
          f"pread time {p['read_s'] * 1e3:.1f} ms, forward waited {p['wait_s'] * 1e3:.2f} ms")
    for key, label in (("decode_cold", "decode, cold page cache"), ("decode_lru_hits", "decode, all rows cached")):
        d = results[key]
        print(f"{label}: median step {d['step_s'] * 1e3:.2f} ms; per token: {d['rows_read_per_token']:.1f} rows, "
              f"{d['bytes_read_per_token']:.0f} B read (kernel rchar {d['kernel_rchar'] / args.tokens:.0f} B, "
              f"device {d['kernel_read_bytes'] / args.tokens:.0f} B), pread {d['read_s_per_token'] * 1e3:.3f} ms, "
              f"waited {d['wait_s_per_token'] * 1e3:.3f} ms")
    cold, hot = results["decode_cold"], results["decode_lru_hits"]
    print(f"\nreads add {cold['wait_s_per_token'] * 1e3:.3f} ms per decode step (time blocked on rows; "
          f"{(cold['step_s'] - hot['step_s']) * 1e3:+.3f} ms median step difference vs all-cached), "
          f"{cold['bytes_read_per_token']:.0f} B read per token of a "
          f"{table.rows * table.row_bytes / 2**20:.0f} MiB table")
    table.close()


if __name__ == "__main__":
    main()
