"""Expert parallelism: each MoE layer's experts sharded over processes and hosts (torch.distributed).

Launched by `torchrun` with `--expert-parallel`. Rank 0 runs the dense layers, sampling and the
HTTP server; every rank keeps its share of each layer's experts in its own tiers. Per MoE layer,
rank 0 sends the step's hidden states and routing to the other ranks, each computes its experts
with its own hybrid executor, and the partial outputs are summed back on rank 0.

share     which rank holds which experts (bytes, and expected load from a trace); the shard's view
shard     one rank's experts in its own homes, cache and executor
link      the process group, the per-layer exchange (broadcast/reduce or all-to-all), its counters
rank0     the engine side: the experts provider (`ParallelProvider`) whose layers go to the ranks
worker    the loop non-zero ranks run until rank 0 says stop
cli       the flags, the rank split for `strata run` / `strata serve`, `strata plan`'s per-rank lines
"""
