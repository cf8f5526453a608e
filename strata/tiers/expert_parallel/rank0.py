"""Rank 0's side: its own share in its tiers, and `Experts` backends that hand each layer to the ranks."""

from __future__ import annotations

import atexit

import torch

from strata.tiers.expert_parallel.link import Link, join
from strata.tiers.expert_parallel.share import partition
from strata.tiers.expert_parallel.shard import Shard
from strata.tiers.expert_parallel.worker import handshake


class ShardedExperts:
    """Stands in for `ResidentExperts` inside an `Experts` module: the layer's experts across ranks."""

    def __init__(self, runtime: "ParallelRuntime", layer: int):
        self.runtime, self.layer = runtime, layer

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rt = self.runtime
        return rt.link.run_layer(self.layer, x, ids, weights, rt.prefill,
                                 lambda x, ids, w: rt.shard.run(self.layer, x, ids, w))


class ParallelRuntime:
    """What `Engine.tiers` holds under --expert-parallel: stats (rank 0's tiers, the exchange, the
    other ranks' shards) and close (stops the ranks)."""

    def __init__(self, shard: Shard, link: Link, shares, decode_width: int):
        self.shard, self.link, self.shares = shard, link, shares
        self.decode_width = decode_width
        self.prefill = False
        self.closed = False

    @property
    def plan(self):
        """Rank 0's own plan (its dense weights and its share of the experts)."""
        return self.shard.plan

    @property
    def unavailable(self) -> str | None:
        """Why the job can no longer serve (a rank died or went silent), or None."""
        return str(self.link.broken) if self.link.broken is not None else None

    def before_block(self, block: int, x: torch.Tensor, step) -> None:
        if block == 0:
            self.prefill = step.width > self.decode_width
            self.shard.executor.prefill = self.prefill

    def stats(self) -> dict:
        out = self.shard.stats()
        ep = self.link.stats()
        ep["shares"] = [{"rank": r, "experts": sum(len(self.shares.layers[layer][r]) for layer in self.shares.layers)}
                        for r in range(self.shares.world)]
        ep["ranks"] = [] if self.link.broken is not None else self.link.rank_stats()
        out["expert_parallel"] = ep
        return out

    def close(self) -> None:
        if self.closed:
            return None
        self.closed = True
        self.link.stop()
        self.shard.close()
        return None


def install(loaded, options) -> ParallelRuntime:
    """Rank 0: join the group, load its share, wait for every rank's, hook the model's MoE layers."""
    import torch.distributed as dist

    from strata.models.layers import Experts
    from strata.tiers.runtime import _decode_width

    rank, world = join(options.dist_timeout)
    if rank != 0:  # the CLI sends other ranks to the worker loop before loading a model
        raise RuntimeError("expert_parallel.install runs on rank 0 only")
    shares = partition(loaded.source, world, options.ep_trace)
    shard = Shard(loaded.source, loaded.config, options, shares.of(0), rank=0)
    if shard.device.is_cuda:  # rank 0's non-expert blocks on its device, as the single-process runtime does
        from strata.tiers.placement import place_blocks

        place_blocks(loaded.model, shard.plan, shard.device.torch_device)
    try:
        handshake(shares, loaded.source, rank, world)
        dist.barrier()  # every shard loaded
    except Exception as e:
        from strata.tiers.expert_parallel.link import ExpertParallelError, network_error

        if isinstance(e, ExpertParallelError):
            raise
        raise network_error(e, options.dist_timeout, "a rank") from None
    link = Link(shares, options.ep_comm, options.dist_timeout)
    runtime = ParallelRuntime(shard, link, shares, _decode_width(loaded.model, options))
    for m in loaded.model.modules():
        if isinstance(m, Experts):
            m.backend = ShardedExperts(runtime, m.layer)
    loaded.model.before_block = runtime.before_block
    atexit.register(runtime.close)
    return runtime
