"""Rank 0's side: its own share in its tiers, and the experts provider whose layers go to the ranks."""

from __future__ import annotations

import atexit

import torch

from strata.errors import StrataError
from strata.tiers.expert_parallel.link import Link, join
from strata.tiers.expert_parallel.share import partition
from strata.tiers.expert_parallel.shard import Shard
from strata.tiers.expert_parallel.worker import handshake


class ShardedExperts:
    """One MoE layer's face in the model (what `ParallelProvider.layer` returns): its experts across
    the ranks, once `install` has joined them."""

    def __init__(self, provider: "ParallelProvider", layer: int):
        self.provider, self.layer = provider, layer

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rt = self.provider.runtime
        if rt is None:
            raise StrataError("the expert-parallel experts ran before the ranks were joined",
                              "call strata.tiers.expert_parallel.rank0.install(loaded, options) first")
        return rt.link.run_layer(self.layer, x, ids, weights, rt.prefill,
                                 lambda x, ids, w: rt.shard.run(self.layer, x, ids, w))


class ParallelProvider:
    """The `ExpertsProvider` of rank 0 under --expert-parallel (`strata.models.seams`)."""

    def __init__(self):
        self.runtime: ParallelRuntime | None = None

    def layer(self, index: int, gate, up, down) -> ShardedExperts:
        return ShardedExperts(self, index)  # the shards read their experts from the file themselves

    def begin_block(self, index: int, x: torch.Tensor, step) -> None:
        if self.runtime is not None:
            self.runtime.begin_block(index, x, step)


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

    def begin_block(self, block: int, x: torch.Tensor, step) -> None:
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
    """Rank 0: join the group, load its share, wait for every rank's, then complete the provider the
    model was built with (`ParallelProvider`; a `BlockPlacement` for the device)."""
    import torch.distributed as dist

    from strata.tiers.runtime import _decode_width

    provider = loaded.model.seams.experts
    if not isinstance(provider, ParallelProvider):
        raise StrataError("the model was built without the expert-parallel experts provider",
                          "build it with Seams(experts=ParallelProvider()) (strata.loader.load_with_tiers does)")

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
    provider.runtime = runtime
    atexit.register(runtime.close)
    return runtime
