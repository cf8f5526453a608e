"""The process group and the per-layer exchange between rank 0 and the expert ranks.

Every message starts with a header broadcast from rank 0 (op, layer, tokens, top-k, prefill,
dtype). For a layer, two ways to move the data, chosen by `--ep-comm`:
- broadcast: every rank gets all the step's hidden states and routing; partial outputs are summed
  onto rank 0 by one reduce. Fewest calls; each rank receives every token.
- alltoall: the routing is broadcast (N x k ids and weights, small); hidden states go only to the
  ranks holding an expert a token chose, and their partial outputs only back, by all-to-all.
Both are gloo collectives (torch.distributed), bounded by the group's timeout (`--dist-timeout`):
a rank that dies or stops answering is an `ExpertParallelError` on rank 0, not a hang.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from strata.errors import BadOption, StrataError

OP_STOP, OP_LAYER, OP_PING, OP_STATS = 0, 1, 2, 3
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
COMMS = ("broadcast", "alltoall")


class ExpertParallelError(StrataError):
    """A rank is gone or silent; the server answers 503 with this reason."""

    unavailable = True


def join(timeout_s: float) -> tuple[int, int]:
    """Join the job torchrun started (its RANK, WORLD_SIZE, MASTER_ADDR/PORT): (rank, world size)."""
    if timeout_s <= 0:
        raise BadOption(f"--dist-timeout must be positive, not {timeout_s}")
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise BadOption(f"--expert-parallel: {missing[0]} is not set, so this is not a torchrun job",
                            "launch with torchrun --nproc-per-node N -m strata.cli ... --expert-parallel")
        world = int(os.environ["WORLD_SIZE"])
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as e:  # the store's own timeout: a rank never joined
            raise ExpertParallelError(f"expert parallel: not all {world} ranks joined within --dist-timeout "
                                      f"{timeout_s:g} s ({_first_line(e)})",
                                      "start every rank, check MASTER_ADDR/MASTER_PORT, or raise --dist-timeout") \
                from None
    return dist.get_rank(), dist.get_world_size()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:  # gloo prefixes its source location
        text = text.split("] ", 1)[1]
    return text.replace(" GLHF! 🏖️", "")


def network_error(e: BaseException, timeout_s: float, who: str) -> ExpertParallelError:
    text = _first_line(e)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return ExpertParallelError(f"expert parallel: {who} did not answer within --dist-timeout {timeout_s:g} s "
                                   f"({text})", "restart the job; torchrun --max-restarts does it for you")
    return ExpertParallelError(f"expert parallel: {who} stopped answering ({text})",
                               "restart the job; torchrun --max-restarts does it for you")


def header(op: int, layer: int = 0, n: int = 0, k: int = 0, prefill: bool = False,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([op, layer, n, k, int(prefill), DTYPES.index(dtype)], dtype=torch.long)


def pack_routing(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, 2k) float32: ids bit-cast from int32, then the weights (exact for bf16/f16 too)."""
    return torch.cat([ids.to(torch.int32).view(torch.float32), weights.float()], dim=1)


def unpack_routing(routing: torch.Tensor, k: int, dtype: torch.dtype):
    return routing[:, :k].contiguous().view(torch.int32).long(), routing[:, k:].to(dtype)


def rows_for(owners: torch.Tensor, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """Indices of the tokens that chose at least one expert held by `rank`."""
    return torch.nonzero((owners[ids] == rank).any(dim=1)).reshape(-1)


class LayerCounts:
    __slots__ = ("calls", "tokens", "sent", "received", "comm_s", "local_s")

    def __init__(self):
        self.calls = self.tokens = self.sent = self.received = 0
        self.comm_s = self.local_s = 0.0


class Link:
    """Rank 0's end: one exchange per MoE layer call, a heartbeat while idle, stop at close."""

    def __init__(self, shares, comm: str, timeout_s: float):
        if comm not in COMMS:
            raise BadOption(f"--ep-comm {comm!r} is not one of {', '.join(COMMS)}")
        self.shares, self.comm, self.timeout_s = shares, comm, timeout_s
        self.world = dist.get_world_size()
        self.owners = {layer: shares.owners(layer) for layer in shares.layers}
        self.layers: dict[int, LayerCounts] = {}
        self.lock = threading.Lock()
        self.broken: ExpertParallelError | None = None
        self.last = time.monotonic()
        self.stopped = threading.Event()
        self.heartbeat = threading.Thread(target=self._beat, name="strata-ep-heartbeat", daemon=True)
        self.heartbeat.start()

    # -- guarded collectives ---------------------------------------------------------------------

    def _call(self, fn):
        if self.broken is not None:
            raise self.broken
        try:
            return fn()
        except ExpertParallelError as e:
            self.broken = e
            raise
        except Exception as e:  # gloo: connection closed, timed out
            self.broken = network_error(e, self.timeout_s, "a rank")
            raise self.broken from None
        finally:
            self.last = time.monotonic()

    def _beat(self) -> None:
        """Idle ranks wait at most --dist-timeout for a message: say 'still here' well before."""
        period = max(self.timeout_s / 4, 0.05)
        while not self.stopped.wait(period):
            if time.monotonic() - self.last < period:
                continue
            with self.lock:
                if self.stopped.is_set() or self.broken is not None:
                    return
                try:
                    self._call(lambda: dist.broadcast(header(OP_PING), 0))
                except ExpertParallelError:
                    return

    # -- a layer ---------------------------------------------------------------------------------

    def run_layer(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, prefill: bool,
                  local) -> torch.Tensor:
        """The layer's routed output: `local(x, ids, weights)` (rank 0's share) plus the others'."""
        with self.lock:
            return self._call(lambda: self._exchange(layer, x, ids, weights, prefill, local))

    def _exchange(self, layer, x, ids, weights, prefill, local) -> torch.Tensor:
        c = self.layers.setdefault(layer, LayerCounts())
        device, x = x.device, x.detach().cpu().contiguous()
        n, k = ids.shape
        c.calls += 1
        c.tokens += n
        t0 = time.perf_counter()
        dist.broadcast(header(OP_LAYER, layer, n, k, prefill, x.dtype), 0)
        routing = pack_routing(ids.cpu(), weights.cpu())
        others = self.world - 1
        if self.comm == "broadcast":
            dist.broadcast(x, 0)
            dist.broadcast(routing, 0)
            c.sent += others * (x.numel() * x.element_size() + routing.numel() * 4 + 48)
            t1 = time.perf_counter()
            out = local(x, ids.cpu(), weights.cpu()).contiguous()
            t2 = time.perf_counter()
            dist.reduce(out, 0, op=dist.ReduceOp.SUM)
            c.received += others * out.numel() * out.element_size()
        else:
            dist.broadcast(routing, 0)
            rows = [torch.zeros(0, dtype=torch.long)]  # rank 0 computes its share from x itself
            rows += [rows_for(self.owners[layer], ids.cpu(), r) for r in range(1, self.world)]
            counts = [len(r) for r in rows]
            row_bytes = x.shape[1] * x.element_size()
            send = torch.cat([x[r] for r in rows])
            mine = torch.empty(counts[0], x.shape[1], dtype=x.dtype)
            dist.all_to_all_single(mine, send, [counts[0]] + [0] * others, counts)
            c.sent += others * (routing.numel() * 4 + 48) + sum(counts[1:]) * row_bytes
            t1 = time.perf_counter()
            out = local(x, ids.cpu(), weights.cpu()).contiguous()
            t2 = time.perf_counter()
            parts = torch.empty(sum(counts), x.shape[1], dtype=x.dtype)
            dist.all_to_all_single(parts, torch.zeros(counts[0], x.shape[1], dtype=x.dtype), counts,
                                   [counts[0]] + [0] * others)
            start = counts[0]
            for r in range(1, self.world):
                out.index_add_(0, rows[r], parts[start:start + counts[r]])
                start += counts[r]
            c.received += sum(counts[1:]) * row_bytes
        t3 = time.perf_counter()
        c.comm_s += (t1 - t0) + (t3 - t2)
        c.local_s += t2 - t1
        return out.to(device)

    # -- control ---------------------------------------------------------------------------------

    def rank_stats(self) -> list[dict]:
        """Every other rank's shard statistics (one small round trip)."""
        with self.lock:
            def gather():
                dist.broadcast(header(OP_STATS), 0)
                got = [None] * self.world
                dist.gather_object({}, got, dst=0)
                return got[1:]
            return self._call(gather)

    def stop(self) -> None:
        """Tell the ranks to leave their loop; idempotent; leaves the group."""
        self.stopped.set()
        with self.lock:
            if self.broken is None:
                try:
                    dist.broadcast(header(OP_STOP), 0)
                except Exception:
                    pass
        if dist.is_initialized():
            dist.destroy_process_group()

    def stats(self) -> dict:
        per_layer = {str(k): {"calls": v.calls, "tokens": v.tokens, "bytes_sent": v.sent,
                              "bytes_received": v.received, "comm_s": v.comm_s, "local_s": v.local_s}
                     for k, v in sorted(self.layers.items())}
        first = min(self.layers, default=None)
        tokens = self.layers[first].tokens if first is not None else 0
        sent = sum(v.sent for v in self.layers.values())
        received = sum(v.received for v in self.layers.values())
        comm = sum(v.comm_s for v in self.layers.values())
        return {"world_size": self.world, "comm": self.comm, "tokens": tokens,
                "bytes_sent": sent, "bytes_received": received, "comm_s": comm,
                "local_s": sum(v.local_s for v in self.layers.values()),
                "bytes_sent_per_token": sent / tokens if tokens else 0.0,
                "bytes_received_per_token": received / tokens if tokens else 0.0,
                "comm_s_per_token": comm / tokens if tokens else 0.0,
                "broken": str(self.broken) if self.broken else None, "per_layer": per_layer}
