"""The --expert-parallel flags, the rank split for `strata run` / `strata serve`, and `strata plan`'s
per-rank lines."""

from __future__ import annotations

import argparse

from strata.tiers.expert_parallel.link import COMMS


def add_parallel_args(p: argparse.ArgumentParser, plan: bool = False) -> None:
    g = p.add_argument_group("expert parallelism (launch every rank with torchrun)")
    g.add_argument("--expert-parallel", action="store_true",
                   help="shard each MoE layer's experts over the torchrun job's ranks; rank 0 runs the rest")
    g.add_argument("--ep-trace", metavar="TRACE",
                   help="balance each layer's experts over the ranks by their use in this routing trace")
    if plan:
        g.add_argument("--world-size", type=int, default=None, help="ranks to plan for (with --expert-parallel)")
        return
    g.add_argument("--dist-timeout", type=float, default=120.0,
                   help="seconds to wait for a rank to join or answer before failing (default 120)")
    g.add_argument("--ep-comm", default="broadcast", choices=COMMS,
                   help="broadcast: all tokens to every rank, one reduce back; alltoall: only the tokens "
                        "that chose a rank's experts")


def parallel_options(args) -> dict:
    return dict(expert_parallel=args.expert_parallel, ep_trace=args.ep_trace, dist_timeout=args.dist_timeout,
                ep_comm=args.ep_comm)


def worker_or_none(args, options: dict) -> int | None:
    """Under --expert-parallel: join the job; a non-zero rank serves its share and returns its exit
    code here; rank 0 gets None and goes on to load the engine (which installs the sharded experts)."""
    if not args.expert_parallel:
        return None
    from strata.runtime.engine import EngineOptions
    from strata.tiers.expert_parallel.link import join

    opts = EngineOptions.from_kwargs(**options)  # a bad flag fails on every rank alike, before joining
    rank, world = join(opts.dist_timeout)
    if rank == 0:
        _stop_on_sigterm()
        return None
    from strata.tiers.expert_parallel.worker import serve

    return serve(args.model, opts, rank, world)


def _stop_on_sigterm() -> None:
    """torchrun stops the other ranks of a host with SIGTERM when one exits: say so in one line."""
    import signal
    import threading

    from strata.tiers.expert_parallel.link import ExpertParallelError

    def stop(signum, frame):
        raise ExpertParallelError("expert parallel: the launcher stopped rank 0 (SIGTERM), most likely because "
                                  "another rank exited", "see that rank's log above, then restart the job")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, stop)


def plan_lines(source, config, opts, world: int, trace: str | None) -> tuple[list[str], list[dict]]:
    """Each rank's share: experts, bytes, and the tiers its own plan puts them in."""
    from strata.tiers import hardware
    from strata.tiers.expert_parallel.share import partition
    from strata.tiers.plan import summary
    from strata.tiers.sizes import format_size

    from strata.tiers.expert_parallel.shard import shard_options, shard_plan

    shares = partition(source, world, trace)
    device = hardware.device_info()
    opts = shard_options(opts, device)
    lines = [f"expert parallel over {world} ranks (rank 0 also holds the dense weights; "
             f"{'balanced by the trace ' + trace if trace else 'balanced by bytes'})",
             f"  {'rank':>4} {'experts':>8} {'expert bytes':>13} {'gpu':>11} {'ram':>11} {'disk':>11}  homes"]
    rows = []
    for rank in range(world):
        share = shares.of(rank)
        plan = shard_plan(source, config, opts, share, rank, device)
        s = summary(plan)
        s.update(rank=rank, experts=sum(len(v) for v in share.values()))
        rows.append(s)
        tb = s["tier_bytes"]
        homes = ",".join(f"{k} {v} layers" for k, v in sorted(s["expert_homes"].items())) or "-"
        lines.append(f"  {rank:>4} {s['experts']:>8} {format_size(plan.expert_bytes()):>13} "
                     f"{format_size(tb['gpu']):>11} {format_size(tb['ram']):>11} {format_size(tb['disk']):>11}  "
                     f"{homes}")
    return lines, rows


def describe_stats(tiers: dict) -> str:
    """The end-of-run lines `strata run` prints under --expert-parallel. A token forwarded is one
    position through the model (prompt or generated); bytes and time are summed over the MoE layers."""
    ep = tiers["expert_parallel"]
    n = max(ep["tokens"], 1)
    lines = [f"[expert parallel: {ep['world_size']} ranks, {ep['comm']}; per token forwarded "
             f"{ep['bytes_sent_per_token'] / 1024:.1f} KiB sent, {ep['bytes_received_per_token'] / 1024:.1f} KiB "
             f"received, {1e3 * ep['comm_s_per_token']:.2f} ms in communication ({ep['tokens']} tokens)]",
             f"  rank 0: {tiers['experts_held']} experts in {_homes(tiers)}, "
             f"{1e3 * ep['local_s'] / n:.2f} ms computing per token forwarded"]
    for r in ep.get("ranks", []):
        lines.append(f"  rank {r['rank']}: {r['experts_held']} experts in {_homes(r)}, {r['requests']} layer "
                     f"requests, {1e3 * r['compute_s'] / n:.2f} ms computing per token forwarded")
    return "\n".join(lines)


def _homes(tiers: dict) -> str:
    return "+".join(sorted(tiers["plan"]["expert_homes"])) or "no tier"
