"""Expert parallelism on localhost: 2 ranks holding the experts in RAM against one process reading
them from disk, at batch 1 and 8, for both exchanges (broadcast/reduce and all-to-all).

The model is `strata synth --like qwen4exp --quant IQ2_XS` cut to a few layers and experts (the
flagship's per-layer shapes: hidden 2560, 1.78 MiB per expert), sized so its experts exceed one
rank's --ram-memory but fit two. Printed side by side from one run: decode tok/s, bytes moved per
generated token, time in communication, and each rank's compute; then a paper estimate for the full
flagship (48 layers x 512 experts, top-10) over 2 and 4 hosts on 10 GbE and 1 GbE, from these costs.

    python bench/bench_expert_parallel.py            # writes the model to /tmp/strata-ep-bench/
    python bench/bench_expert_parallel.py --model M --ram-memory 800M --tokens 24 --repeats 3

The driver runs every configuration in its own processes (one `torchrun --standalone
--nproc-per-node 2` per expert-parallel configuration), one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20

# The full flagship (docs/ARCHITECTURE.md section 6): Qwen3.8-Flash-Next at IQ2_XS as `strata synth` writes it.
FLAGSHIP = dict(layers=48, experts=512, top_k=10, hidden=2560, expert_bytes=1.78 * MiB, dense_bytes=3e9)
LINKS = {"10 GbE": 10e9 / 8 * 0.94, "1 GbE": 1e9 / 8 * 0.94}  # payload bytes/s after TCP/IP framing
LINK_LATENCY_S = {"10 GbE": 30e-6, "1 GbE": 60e-6}  # one-way, host to host through a switch (typical)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a GGUF (default: synthesised into --workdir)")
    p.add_argument("--workdir", default="/tmp/strata-ep-bench")
    p.add_argument("--layers", type=int, default=4, help="layers of the synthesised model")
    p.add_argument("--experts", type=int, default=128, help="experts per layer of the synthesised model")
    p.add_argument("--ram-memory", default="800M", help="each rank's RAM budget (the single process's too)")
    p.add_argument("--tokens", type=int, default=24, help="tokens generated per measured run")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per configuration (median)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2,
                   help="times the three configurations run in turn (a shared machine's load drifts)")
    p.add_argument("--role", choices=["driver", "single", "parallel"], default="driver", help=argparse.SUPPRESS)
    p.add_argument("--comm", default="broadcast", help=argparse.SUPPRESS)
    return p.parse_args()


# -- the measured processes -------------------------------------------------------------------------

def prompts(batch: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, vocab, (8,), generator=g).tolist() for _ in range(batch)]


def measure(engine, args, snapshot) -> list[dict]:
    """Per batch size: median decode tok/s over the repeats, and the counters' per-token deltas."""
    out = []
    for batch in args.batch:
        ps = prompts(batch, engine.config.vocab_size)
        engine.generate(ps, 4, stop_at_eos=False)  # warm: kernels, caches, connections
        runs = []
        for _ in range(args.repeats):
            before = snapshot()
            t0 = time.perf_counter()
            outs = engine.generate(ps, args.tokens, stop_at_eos=False)
            wall = time.perf_counter() - t0
            after = snapshot()
            generated = sum(len(o) for o in outs)
            runs.append({"decode_tok_s": engine.stats["decode_tokens_per_s"], "wall_s": wall,
                         "generated": generated,
                         **{k: (after[k] - before[k]) / generated for k in after}})
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        out.append({"batch": batch, **med})
    return out


def single(args) -> None:
    import strata

    engine = strata.load(args.model, pin_experts="disk", ram_memory=args.ram_memory, experts_cache="0",
                         cpu_threads=2, draft="off")

    def snapshot():
        homes = engine.tiers.stats()["homes"]
        return {"disk_bytes": sum(h.get("bytes_read", 0) for h in homes)}

    print(json.dumps({"config": "1 process, experts on disk", "plan": engine.tiers.stats()["plan"],
                      "results": measure(engine, args, snapshot)}), flush=True)
    engine.close()


def parallel(args) -> None:
    from strata.runtime.engine import EngineOptions
    from strata.tiers.expert_parallel.link import join

    options = dict(pin_experts="ram", ram_memory=args.ram_memory, cpu_threads=1, draft="off",
                   expert_parallel=True, ep_comm=args.comm, dist_timeout=300.0)
    rank, world = join(300.0)
    if rank > 0:
        from strata.tiers.expert_parallel.worker import serve

        serve(args.model, EngineOptions.from_kwargs(**options), rank, world)
        return
    import strata

    engine = strata.load(args.model, **options)
    link = engine.tiers.link

    def snapshot():
        s = link.stats()
        ranks = link.rank_stats()
        return {"bytes_moved": s["bytes_sent"] + s["bytes_received"], "comm_s": s["comm_s"],
                "rank0_compute_s": s["local_s"], "remote_compute_s": max(r["compute_s"] for r in ranks),
                "remote_experts": sum(r["total"]["cpu_experts"] + r["total"]["hits"] for r in ranks),
                "exchanges": sum(v["calls"] for v in s["per_layer"].values())}

    held = [engine.tiers.shard.stats()["experts_held"]] + [r["experts_held"] for r in link.rank_stats()]
    probe = {b: exchange_cost(engine, b) for b in args.batch}
    print(json.dumps({"config": f"2 ranks, experts in RAM, {args.comm}", "held": held, "exchange_s": probe,
                      "results": measure(engine, args, snapshot)}), flush=True)
    engine.close()


def exchange_cost(engine, batch: int, n: int = 60) -> float:
    """Median seconds of one layer exchange that moves real-sized data but computes nothing: the
    routing names only experts rank 0 holds, so the other rank answers with zeros at once."""
    import torch

    link, shares = engine.tiers.link, engine.tiers.shares
    layer = min(shares.layers)
    mine = shares.layers[layer][0]
    k = engine.config.n_experts_used
    if len(mine) < k:
        return float("nan")
    x = torch.randn(batch, engine.config.hidden_size)
    ids = torch.tensor([mine[:k]] * batch)
    weights = torch.full((batch, k), 1.0 / k)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        link.run_layer(layer, x, ids, weights, False, lambda x, ids, w: torch.zeros_like(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[n // 6:])


# -- the driver ---------------------------------------------------------------------------------------

def child(args, role: str, comm: str = "broadcast") -> dict:
    own = [str(Path(__file__).resolve()), "--role", role, "--comm", comm, "--model", args.model,
           "--ram-memory", args.ram_memory, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
           "--batch", *map(str, args.batch)]
    if role == "parallel":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *own]
    else:
        cmd = [sys.executable, *own]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{role} {comm} failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def merge(runs: list[dict]) -> dict:
    """One configuration's rounds: the median of each figure."""
    out = dict(runs[0])
    out["results"] = [{k: statistics.median(r["results"][i][k] for r in runs) for k in runs[0]["results"][i]}
                      for i in range(len(runs[0]["results"]))]
    if "exchange_s" in out:
        out["exchange_s"] = {b: statistics.median(r["exchange_s"][b] for r in runs) for b in out["exchange_s"]}
    return out


def synth_model(args) -> str:
    path = Path(args.workdir) / f"qwen4exp-{args.layers}x{args.experts}-iq2_xs.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "strata.cli", "synth", str(path), "--like", "qwen4exp", "--layers",
                        str(args.layers), "--quant", "IQ2_XS", "--experts", str(args.experts), "--vocab", "4096",
                        "--ngram-rows", "4096"], check=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return str(path)


def main() -> None:
    args = parse()
    if args.role == "single":
        return single(args)
    if args.role == "parallel":
        return parallel(args)
    args.model = args.model or synth_model(args)
    print(f"load average before: {os.getloadavg()[0]:.1f} (2 cores; other work shares the machine)")
    rounds = []
    for _ in range(args.rounds):  # in turn, so a change in the machine's load hits every configuration
        rounds.append({"single": child(args, "single"),
                       **{comm: child(args, "parallel", comm) for comm in ("broadcast", "alltoall")}})
    base = merge([r["single"] for r in rounds])
    runs = {comm: merge([r[comm] for r in rounds]) for comm in ("broadcast", "alltoall")}
    print("decode tok/s per round: " + "; ".join(
        f"{name} " + "/".join(f"{r[name]['results'][0]['decode_tok_s']:.2f}" for r in rounds)
        for name in ("single", "broadcast", "alltoall")) + f" (batch {args.batch[0]})")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    p = base["plan"]
    print(f"\nmodel {args.model}: {p['n_experts']} experts, {p['expert_bytes'] / MiB:.0f} MiB of experts, "
          f"--ram-memory {args.ram_memory} per rank; 2 ranks hold {runs['broadcast']['held']} experts in RAM")
    print(f"\n{'configuration':<38} {'batch':>5} {'tok/s':>7} {'vs 1p':>6} {'disk MiB/tok':>12} "
          f"{'KiB moved/tok':>13} {'comm ms/tok':>11} {'rank0 ms/tok':>12} {'rank1 ms/tok':>12} {'exchange us':>11}")
    for i, batch in enumerate(args.batch):
        b = base["results"][i]
        print(f"{base['config']:<38} {batch:>5} {b['decode_tok_s']:>7.2f} {1:>6.2f} {b['disk_bytes'] / MiB:>12.1f} "
              f"{'-':>13} {'-':>11} {'-':>12} {'-':>12} {'-':>11}")
        for comm, run in runs.items():
            r = run["results"][i]
            ratio = r["decode_tok_s"] / b["decode_tok_s"]
            print(f"{run['config']:<38} {batch:>5} {r['decode_tok_s']:>7.2f} {ratio:>6.2f} "
                  f"{0:>12.1f} {r['bytes_moved'] / 1024:>13.1f} {1e3 * r['comm_s']:>11.2f} "
                  f"{1e3 * r['rank0_compute_s']:>12.2f} {1e3 * r['remote_compute_s']:>12.2f} "
                  f"{1e6 * run['exchange_s'][str(batch)]:>11.0f}")
    print(estimate(args, base, runs))


def estimate(args, base, runs) -> str:
    """The full flagship over H hosts from the costs measured here (batch 1, broadcast exchange).

    Per MoE layer a token costs rank 0's dense work, then the busiest host's share of the top-k
    experts (at the per-expert time measured here; the part of a share that does not fit a host's
    RAM read from its disk at 1 GB/s), then the exchange: its bytes over the link, two one-way
    latencies, and the software cost of one exchange as measured on loopback here (`exchange us`,
    inflated on this shared, loaded 2-core machine, where both ranks also share the cores)."""
    r = runs["broadcast"]["results"][0]
    overhead_s = runs["broadcast"]["exchange_s"][str(args.batch[0])]
    n = max(r["exchanges"], 1)  # MoE layer calls per generated token
    per_expert_s = r["remote_compute_s"] / max(r["remote_experts"], 1e-9)
    dense_s = max(1 / r["decode_tok_s"] - r["comm_s"] - r["rank0_compute_s"], 0.0) / n
    f = FLAGSHIP
    ram = 0.9 * 24e9
    total = f["layers"] * f["experts"] * f["expert_bytes"]
    lines = ["", "paper estimate: full flagship (48 layers x 512 experts, top-10, hidden 2560, 1.78 MiB per expert "
             "at IQ2_XS), batch 1, broadcast exchange, hosts like this one (2 cores, 24 GB RAM, ~1 GB/s disk)",
             f"  from this run: {1e3 * per_expert_s:.2f} ms per expert on one core, rank 0's dense work "
             f"{1e3 * dense_s:.2f} ms per layer, {1e6 * overhead_s:.0f} us per exchange on loopback (no compute)",
             f"  {'hosts':>5} {'link':>7} {'GiB/host':>8} {'on disk':>7} {'KiB/tok':>7} {'network ms':>10} "
             f"{'experts ms':>10} {'dense ms':>8} {'tok/s':>6}"]
    one_disk = max(0.0, 1 - (ram - f["dense_bytes"]) / total)
    one_experts = f["layers"] * f["top_k"] * (per_expert_s + one_disk * f["expert_bytes"] / 1e9)
    lines.append(f"  {1:>5} {'-':>7} {(total + f['dense_bytes']) / 2**30:>8.1f} {one_disk:>7.0%} {0:>7} {0:>10.1f} "
                 f"{1e3 * one_experts:>10.1f} {1e3 * f['layers'] * dense_s:>8.1f} "
                 f"{1 / (one_experts + f['layers'] * dense_s):>6.2f}")
    for hosts in (2, 4):
        share = (total + f["dense_bytes"]) / hosts  # balanced by bytes, rank 0's dense weights counted
        on_disk = max(0.0, 1 - ram / share)
        per_layer_bytes = (hosts - 1) * (2 * f["hidden"] * 4 + 2 * f["top_k"] * 4 + 48)
        busiest = f["top_k"] / hosts * 1.3  # the busiest host's share of a layer's experts (routing imbalance)
        expert_s = f["layers"] * busiest * (per_expert_s + on_disk * f["expert_bytes"] / 1e9)
        dense = f["layers"] * dense_s
        for link, bw in LINKS.items():
            net = f["layers"] * (per_layer_bytes / bw + 2 * LINK_LATENCY_S[link] + overhead_s)
            lines.append(f"  {hosts:>5} {link:>7} {share / 2**30:>8.1f} {on_disk:>7.0%} "
                         f"{f['layers'] * per_layer_bytes / 1024:>7.0f} {1e3 * net:>10.1f} {1e3 * expert_s:>10.1f} "
                         f"{1e3 * dense:>8.1f} {1 / (net + expert_s + dense):>6.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
