"""CUDA graphs for the dense segments of a decode step, between the step's host boundaries.

A decode step on the device is dense work (norms, projections, rope, routers, resident experts
through `strata::experts`, residual adds) cut at a few places that must run on the host, eagerly:
- each tiered MoE layer's routing read (`HybridExecutor.run`): the host must see the ids before it
  picks slots, copies and CPU work;
- the attention over the KV cache (`KVCache.attend` and the tiered KV's): its length grows every
  step, a shape no captured graph can keep (vLLM's piecewise graphs leave attention out too);
- the tiers' step bookkeeping before each block (positions, the prefetcher's prediction).
`boundary` marks those functions (`torch.compiler.disable`), so `torch.compile` splits the step
exactly there; with mode="reduce-overhead" each dense segment is captured once as a CUDA graph
and replayed every step (torch's cudagraph trees), the boundaries running eagerly between them.
Other host reads dynamo meets (qwen4exp's n-gram hash of the tokens, say) split further, correctly.

`enable(model, device)` routes one-token-per-row decode calls through the compiled forward;
prefill, speculative verify passes and tapped calls stay eager (their shapes change per call),
and so does everything with `--cuda-graphs off`. On the CPU the same split runs with dynamo's
"eager" backend (no capture): the tests check the segments and that the output equals eager.
"""

from __future__ import annotations

import functools

import torch

from strata.errors import BadOption


_BOUNDARIES: list[list] = []  # [the function to call, the host function] per boundary


def boundary(fn):
    """A step function that runs on the host: compiled decode steps break their graph here.

    `torch.compiler.disable` is applied when a step is first compiled, not at import: it imports
    torch._dynamo, which doubled every process's start (1.3 -> 2.5 s)."""
    target = [fn, fn]
    _BOUNDARIES.append(target)

    @functools.wraps(fn)
    def host_step(*args, **kwargs):
        return target[0](*args, **kwargs)

    return host_step


def disable_boundaries() -> None:
    for target in _BOUNDARIES:
        if target[0] is target[1]:
            target[0] = torch.compiler.disable(target[1], recursive=True)


class DecodeGraphs:
    """`model.forward` with decode calls (tokens (B, 1), no tap) compiled, the rest eager."""

    def __init__(self, forward, mode: str | None = "reduce-overhead", backend: str | None = None):
        self.eager = forward
        kwargs = {"backend": backend} if backend else {"mode": mode}
        disable_boundaries()
        self.compiled = torch.compile(forward, dynamic=False, **kwargs)
        self.calls = 0  # decode calls that went through the compiled forward

    def __call__(self, tokens, cache, n_new=None, tap=None, last_only: bool = False, hidden: bool = False):
        if tap is not None or tokens.shape[1] != 1:
            kwargs = {} if tap is None else {"tap": tap}
            return self.eager(tokens, cache, n_new=n_new, last_only=last_only, hidden=hidden, **kwargs)
        self.calls += 1
        try:
            return self.compiled(tokens, cache, n_new=n_new, last_only=last_only, hidden=hidden)
        except Exception as e:  # noqa: BLE001  (compile or capture failed part-way: the step's state is spent)
            if self.calls > 1 or isinstance(e, (KeyboardInterrupt, MemoryError)):
                raise
            raise BadOption(f"CUDA graphs: compiling the decode step failed ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})", "run with --cuda-graphs off") from e


def enable(model, device: torch.device, setting: str = "auto", backend: str | None = None) -> bool:
    """Compile `model`'s decode steps when `setting` allows and its blocks run on a CUDA device (or
    `backend` is given: the CPU tests' "eager"); returns whether it did."""
    if setting not in ("auto", "on", "off"):
        raise BadOption(f"--cuda-graphs {setting!r}", "use auto, on or off")
    if setting == "off" or isinstance(model.forward, DecodeGraphs):
        return False
    on_cuda = device.type == "cuda" and _blocks_on(model, device)
    if backend is None and not on_cuda:
        if setting == "on":
            raise BadOption("--cuda-graphs on needs the model's blocks on a CUDA device",
                            "use --cuda-graphs auto or off, or --gpu-layers all on a machine with CUDA")
        return False
    model.forward = DecodeGraphs(model.forward, backend=backend)
    return True


def _blocks_on(model, device: torch.device) -> bool:
    """Whether every block's tensors (their first parameter or tensor attribute) live on `device`'s type."""
    for block in getattr(model, "blocks", []):
        t = next((v for m in block.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)), None)
        if t is None or t.device.type != device.type:
            return False
    return True
