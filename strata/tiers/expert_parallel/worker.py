"""The loop a non-zero rank runs: load its share, then serve layer requests until rank 0 says stop."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from strata.tiers.expert_parallel.link import (DTYPES, OP_LAYER, OP_PING, OP_STATS, OP_STOP, ExpertParallelError,
                                               network_error, rows_for, unpack_routing)


def handshake(shares, source, rank: int, world: int) -> None:
    """Every rank must have computed the same partition from the same file: compare fingerprints."""
    mine = (shares.fingerprint(), _file_size(source))
    got = [None] * world
    dist.all_gather_object(got, mine)
    for r, theirs in enumerate(got):
        if theirs != got[0]:
            raise ExpertParallelError(f"expert parallel: rank {r} sees a different model or flags than rank 0 "
                                      f"(partition {theirs[0]} vs {got[0][0]}, file {theirs[1]} vs {got[0][1]} bytes)",
                                      "give every rank the same GGUF file and the same flags")


def _file_size(source) -> int:
    import os

    return os.path.getsize(source.file.path)


def serve(model: str, options, rank: int, world: int) -> int:
    """Rank `rank`'s whole life: its share of every MoE layer, computed on request."""
    from strata.formats.checkpoint import open_config
    from strata.tiers.expert_parallel.share import partition
    from strata.tiers.expert_parallel.shard import Shard

    timeout = options.dist_timeout
    try:
        _, config, source, _ = open_config(model)
        shares = partition(source, world, options.ep_trace)
        torch.set_num_threads(max(1, options.cpu_threads or torch.get_num_threads()))
        shard = Shard(source, config, options, shares.of(rank), rank)
        handshake(shares, source, rank, world)
        owners = {layer: shares.owners(layer) for layer in shares.layers}
        dist.barrier()  # every shard loaded
    except ExpertParallelError:
        raise
    except RuntimeError as e:
        if "gloo" in str(e).lower() or "connection" in str(e).lower() or "timed out" in str(e).lower():
            raise network_error(e, timeout, f"rank 0 (seen from rank {rank})") from None
        raise
    homes = "+".join(sorted({x.home for x in shard.plan.experts})) or "no tier"
    print(f"strata: expert-parallel rank {rank}/{world}: {sum(len(v) for v in shares.of(rank).values())} experts "
          f"({shard.plan.expert_bytes() / 2**20:.1f} MiB) in {homes}", file=sys.stderr)
    try:
        with torch.inference_mode():
            _loop(shard, owners, options.ep_comm, rank, world)
    except ExpertParallelError:
        raise
    except Exception as e:
        raise network_error(e, timeout, f"rank 0 (seen from rank {rank})") from None
    finally:
        shard.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _loop(shard, owners, comm: str, rank: int, world: int) -> None:
    head = torch.empty(6, dtype=torch.long)
    compute_s, requests = 0.0, 0
    while True:
        dist.broadcast(head, 0)
        op, layer, n, k, prefill, dtype = head.tolist()
        if op == OP_STOP:
            return
        if op == OP_PING:
            continue
        if op == OP_STATS:
            stats = shard.stats()
            stats.update(rank=rank, compute_s=compute_s, requests=requests)
            dist.gather_object(stats, None, dst=0)
            continue
        if op != OP_LAYER:
            raise ExpertParallelError(f"expert parallel: rank {rank} got an unknown message {op} from rank 0")
        dtype = DTYPES[dtype]
        routing = torch.empty(n, 2 * k, dtype=torch.float32)
        if comm == "broadcast":
            x = torch.empty(n, shard.hidden_size, dtype=dtype)
            dist.broadcast(x, 0)
            dist.broadcast(routing, 0)
            ids, weights = unpack_routing(routing, k, dtype)
            t0 = time.perf_counter()
            shard.executor.prefill = bool(prefill)
            out = shard.run(layer, x, ids, weights).contiguous()
            compute_s += time.perf_counter() - t0
            dist.reduce(out, 0, op=dist.ReduceOp.SUM)
        else:
            dist.broadcast(routing, 0)
            ids, weights = unpack_routing(routing, k, dtype)
            rows = rows_for(owners[layer], ids, rank)
            width = shard.hidden_size
            x = torch.empty(len(rows), width, dtype=dtype)
            dist.all_to_all_single(x, torch.empty(0, width, dtype=dtype), [len(rows)] + [0] * (world - 1),
                                   [0] * world)
            t0 = time.perf_counter()
            shard.executor.prefill = bool(prefill)
            out = shard.run(layer, x, ids[rows], weights[rows]).contiguous()
            compute_s += time.perf_counter() - t0
            splits = [0] * world
            splits[0] = len(rows)
            dist.all_to_all_single(torch.empty(0, width, dtype=dtype), out, [0] * world, splits)
        requests += 1

