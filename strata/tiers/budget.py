"""What the process will hold in RAM, counted before loading: the numbers `--ram-memory` is checked against.

Counted from tensor names, types and shapes and the model's hyper-parameters, never by loading:

  * dense weights as held: their stored bytes (quantized blocks, F16 matrices and F32 vectors stay
    as the file has them); types without a CPU kernel are widened to float32 at load;
  * experts homed in RAM, the RAM cache in front of disk-homed experts, and the device expert cache
    when no CUDA device holds it (its stand-in lives in RAM);
  * the KV cache (keys, values, QSA indexer keys) at the chosen context, twice over because a
    cache grows by doubling, plus each recurrent layer's fixed state;
  * scratch: one prefill chunk's activations and attention scores, dequantized slabs, logits.

The interpreter and its libraries (measured at start, `anon_rss()`) are not in the budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from strata.tiers.sizes import format_size

ATTN_KEYS = re.compile(r"^blk\.(\d+)\.(attn_k|attn_v|indexer\.k_proj)\.weight$")
SSM_A = re.compile(r"^blk\.(\d+)\.ssm_a$")
MIN_CONTEXT = 256
CONTEXT_SHARE = 0.5  # the default context may take this share of what the weights leave
SLAB_BYTES = 64 << 20  # linear.SCRATCH_BYTES: one dequantized slab of a large weight
KV_GROWTH = 2  # a KV cache's capacity may be up to twice what it holds


@dataclass(slots=True)
class StateSizes:
    """Bytes of model state: per token of context (all layers), and fixed per sequence."""

    per_token: int
    fixed: int


def dense_held_bytes(source, names) -> int:
    """Bytes the dense tensors `names` take as the loader keeps them."""
    from strata import kernels
    from strata.formats.weights import FLOAT_TYPES

    total = 0
    for name in names:
        qtype, shape, nbytes = source.info(name)
        float_type = any(t.name == qtype for t in FLOAT_TYPES)
        if float_type or kernels.has_kernel(_qtype(qtype)):
            total += nbytes
        else:  # widened to float32 at load
            n = 1
            for d in shape:
                n *= d
            total += 4 * n
    return total


def _qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


def state_sizes(source, config, dtype_bytes: int = 4) -> StateSizes:
    """KV bytes per token (attention layers' key, value and indexer-key rows) and recurrent state."""
    names = set(source.names())
    per_token = fixed = 0
    for name in names:
        if ATTN_KEYS.match(name):
            per_token += source.info(name)[1][0] * dtype_bytes
        elif SSM_A.match(name):  # a Gated DeltaNet layer: (v heads, d_k, d_v) state and a conv window
            prefix = name[: -len("ssm_a")]
            nv = source.info(name)[1][0]
            dv = source.info(prefix + "ssm_norm.weight")[1][0] if prefix + "ssm_norm.weight" in names else 128
            dk = getattr(config, "linear_k_dim", 0) or dv
            fixed += nv * dk * dv * 4
            if prefix + "ssm_conv1d.weight" in names:
                shape = source.info(prefix + "ssm_conv1d.weight")[1]
                fixed += shape[0] * (shape[-1] - 1) * 4
    return StateSizes(per_token, fixed)


def scratch_bytes(config, chunk: int, ctx: int, dtype_bytes: int = 4) -> int:
    """One prefill chunk's working set: activations of the residual width, the attention scores
    of `chunk` queries over `ctx` keys (softmax and mask included), dequantized slabs, logits."""
    hidden = getattr(config, "hidden_size", 0) or 0
    width = hidden * (getattr(config, "hc_count", 1) or 1)
    heads = getattr(config, "n_heads", 0) or 0
    vocab = getattr(config, "vocab_size", 0) or 0
    ffn = max(getattr(config, "expert_ffn_size", 0) or 0, getattr(config, "ffn_size", 0) or 0,
              getattr(config, "shared_ffn_size", 0) or 0)
    keys = ctx
    activations = chunk * dtype_bytes * (12 * width + 4 * ffn)
    scores = chunk * heads * keys * (2 * dtype_bytes + 1)
    slab = min(SLAB_BYTES, 4 * vocab * hidden)  # the largest weight (the head), a slab of it at a time
    return activations + scores + slab + 4 * vocab * 2


def context_bytes(sizes: StateSizes, ctx: int) -> int:
    return sizes.per_token * ctx * KV_GROWTH + sizes.fixed


def choose_context(sizes: StateSizes, config, free: int, trained: int, chunk: int, dtype_bytes: int = 4) -> int:
    """The trained context, or the longest power of two below it, whose KV, state and prefill
    scratch fit in CONTEXT_SHARE of `free`; 0 when not even MIN_CONTEXT does."""
    allowance = int(free * CONTEXT_SHARE)
    ctx = trained or 4096
    while ctx >= min(MIN_CONTEXT, trained or MIN_CONTEXT):
        kv = context_bytes(sizes, ctx)
        fitted = choose_chunk(config, ctx, min(chunk, ctx), allowance - kv, dtype_bytes)
        if kv + scratch_bytes(config, fitted, ctx, dtype_bytes) <= allowance:
            return ctx
        ctx = 1 << ((ctx - 1).bit_length() - 1)  # the next power of two below
    return 0


def choose_chunk(config, ctx: int, chunk: int, free: int, dtype_bytes: int = 4) -> int:
    """`chunk`, halved until its scratch fits in `free` (at least 64 tokens)."""
    while chunk > 64 and scratch_bytes(config, chunk, ctx, dtype_bytes) > free:
        chunk //= 2
    return chunk


@dataclass(slots=True)
class MemoryPlan:
    """Every line of the RAM budget, in bytes; `total` is what is checked against `budget`."""

    budget: int
    dense: int
    experts: int
    ram_cache: int
    device_standin: int
    kv: int
    scratch: int
    ctx_size: int
    ctx_chosen: bool  # True when the context was chosen to fit, not given
    prefill_chunk: int

    @property
    def total(self) -> int:
        return self.dense + self.experts + self.ram_cache + self.device_standin + self.kv + self.scratch

    def as_dict(self) -> dict:
        return {"budget": self.budget, "total": self.total, "dense": self.dense, "experts": self.experts,
                "ram_cache": self.ram_cache, "device_standin": self.device_standin, "kv": self.kv,
                "scratch": self.scratch, "ctx_size": self.ctx_size, "ctx_chosen": self.ctx_chosen,
                "prefill_chunk": self.prefill_chunk}

    def describe(self) -> str:
        parts = [("dense weights", self.dense), ("experts", self.experts), ("RAM cache", self.ram_cache),
                 ("device-cache stand-in", self.device_standin), (f"KV+state at {self.ctx_size}", self.kv),
                 (f"scratch (prefill chunk {self.prefill_chunk})", self.scratch)]
        shown = " + ".join(f"{what} {format_size(n)}" for what, n in parts if n)
        return f"{format_size(self.total)} = {shown}"


def anon_rss() -> int:
    """This process's anonymous resident memory now (RssAnon), or 0 without /proc."""
    return status_kib("self", "RssAnon:")


def status_kib(pid: int | str, key: str) -> int:
    """A /proc/PID/status field in bytes (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class AnonPeak:
    """Samples a process's RssAnon every `interval` s on a thread: the peak anonymous memory,
    which /proc does not keep (VmHWM counts mapped file pages too)."""

    def __init__(self, pid: int, interval: float = 0.02):
        import threading

        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib(self.pid, "RssAnon:"))
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def return_large_frees_to_the_os(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations of `threshold` bytes or more by mmap, fixed (setting it turns
    the dynamic threshold off). Otherwise, after the first free of a large buffer, glibc raises its
    threshold up to 32 MiB and keeps freed expert reads and dequantized slabs in per-thread arenas:
    anonymous memory far above what the engine holds (measured: 112-178 MiB above the baseline under
    a 160 MiB budget, 51 MiB with the threshold fixed). False where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
