"""One rank's experts in its own tiers: homes (RAM or disk), device cache and hybrid executor.

The shard reads only its experts from the GGUF (explicit reads at their file offsets); expert ids
stay global (the file's), so disk reads, cache keys and traces mean the same on every rank.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from strata import kernels
from strata.errors import BadOption
from strata.tiers import hardware
from strata.tiers.executor import CpuLane, HybridExecutor
from strata.tiers.plan import make_plan, summary
from strata.tiers.runtime import build_cache, build_homes
from strata.tiers.expert_parallel.share import ShardSource, expert_tensors
from strata.tiers.stats import TierStats
from strata.tiers.store import DiskHome, ExpertFormat, FileReader, Home, Part


class ShardRamHome(Home):
    """A share's experts in anonymous RAM (page-locked with CUDA), read once at start, by global id."""

    kind = "ram"

    def __init__(self, formats: dict[int, ExpertFormat], share: dict[int, list[int]], reader: FileReader,
                 pin: bool = False):
        self.formats = formats
        self.row = {layer: {e: i for i, e in enumerate(experts)} for layer, experts in share.items()}
        self.data: dict[int, tuple[torch.Tensor, ...]] = {}
        for layer, fmt in formats.items():
            experts = share[layer]
            parts = []
            for p in fmt.parts:
                out = torch.empty((len(experts), p.nbytes), dtype=torch.uint8, pin_memory=pin)
                for first, rows in _runs(experts):  # one read per run of consecutive ids
                    reader.read_into(out[rows].view(-1), p.offset + first * p.nbytes)
                parts.append(out)
            self.data[layer] = tuple(parts)

    def to_device(self, device: torch.device) -> None:
        self.data = {i: tuple(t.to(device) for t in ts) for i, ts in self.data.items()}
        self.kind = "gpu"

    def parts(self, layer: int, e: int) -> tuple[torch.Tensor, ...]:
        i = self.row[layer][e]
        return tuple(t[i] for t in self.data[layer])

    def stats(self) -> dict:
        return {"home": self.kind, "bytes": sum(t.numel() for ts in self.data.values() for t in ts)}


def _runs(experts: list[int]):
    """(first id, row slice) for each run of consecutive ids in a sorted list."""
    start = 0
    for i in range(1, len(experts) + 1):
        if i == len(experts) or experts[i] != experts[i - 1] + 1:
            yield experts[start], slice(start, i)
            start = i


def formats_from_file(source, layers) -> dict[int, ExpertFormat]:
    """Each MoE layer's expert layout, read from the GGUF's tensor table (no weights loaded)."""
    out = {}
    for layer, names in expert_tensors(source).items():
        if layer in layers:
            infos = [source.file.tensors[n] for n in names]
            out[layer] = ExpertFormat(tuple(Part(t.qtype, t.shape[1:], t.n_bytes // t.shape[0], t.offset)
                                            for t in infos))
    return out


def shard_plan(source, config, options, share: dict[int, list[int]], rank: int, device):
    """The rank's own plan for its share (dense weights on rank 0 only); a refusal names the rank."""
    try:
        return make_plan(ShardSource(source, share, with_dense=rank == 0), config, options, device)
    except BadOption as e:
        raise BadOption(f"rank {rank}'s share: {e.problem}", e.fix) from None


def shard_options(options, device):
    """Without CUDA a rank has no device cache unless asked: a simulated one would copy RAM into RAM."""
    if options.experts_cache is None and not device.is_cuda:
        return replace(options, experts_cache="0")
    return options


class Shard:
    """Plan, homes, cache and executor for the experts `share` names; `run` computes only those."""

    def __init__(self, source, config, options, share: dict[int, list[int]], rank: int):
        if getattr(source, "file", None) is None:
            raise BadOption(f"{getattr(source, 'description', source)}: --expert-parallel needs a GGUF file",
                            "convert the model to GGUF; every rank reads its share from the same file")
        device = self.device = hardware.device_info()
        options = shard_options(options, device)
        self.hidden_size = config.hidden_size
        self.share = {layer: set(experts) for layer, experts in share.items()}
        self.plan = shard_plan(source, config, options, share, rank, device)
        self.formats = formats_from_file(source, share)
        self.reader = FileReader(source.file.path)
        self.homes = build_homes(self.plan, self.formats, self.reader, device,
                                 lambda fmts, kind: ShardRamHome(fmts, share, self.reader,
                                                                 pin=device.is_cuda and kind == "ram"))
        n_experts = max((source.info(names[0])[1][0] for names in expert_tensors(source).values()), default=1)
        self.cache = build_cache(self.plan, options, self.homes, self.formats, n_experts, device) if self.formats else None
        self.lane = CpuLane(getattr(options, "cpu_threads", 0) or 1, self.homes, self.formats)
        self.executor = HybridExecutor(self.homes, self.formats, self.cache, self.lane, TierStats(), n_experts,
                                       device.torch_device)

    def holds(self, layer: int, ids: torch.Tensor) -> bool:
        mine = self.share.get(layer)
        return bool(mine) and any(e in mine for e in torch.unique(ids).tolist())

    def run(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's part of the layer's output: its experts' products in the router's weights."""
        if not self.holds(layer, ids):
            return torch.zeros_like(x)
        # a prompt's forward on rank 0 (`executor.prefill`): here too its products take prefill.c's
        with kernels.prompt_batches() if self.executor.prefill else nullcontext():
            return self.executor.run(layer, x, ids, weights, experts=self.share[layer])

    def stats(self) -> dict:
        resident = self.cache.resident_per_layer() if self.cache else {}
        out = self.executor.stats.as_dict(resident)
        out["plan"] = summary(self.plan)
        out["policy"] = self.cache.regions[0].policy.name if self.cache else None
        out["homes"] = [h.stats() for h in {id(h): h for h in self.homes.values()}.values()]
        out["experts_held"] = sum(len(v) for v in self.share.values())
        return out

    def close(self) -> None:
        self.lane.close()
        if self.cache is not None:
            self.cache.copier.close()
        self.reader.close()
