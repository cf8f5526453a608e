"""What the device must keep free besides weights, reserved before the expert cache takes the rest.

- KV cache at the context size: every attention layer's keys and values (rows of `attn_k` and
  `attn_v`), plus a QSA layer's indexer keys, for `ctx` positions of one sequence, in the run's dtype.
- Recurrent state: a Gated DeltaNet layer's fp32 state (value heads x d_k x d_v) and conv window.
- Activations: a prefill chunk's widest live tensors (residual streams, q/k/v, the FFN's
  intermediate for the routed top-k and the shared expert, one layer at a time), in float32.
- Scratch: the allocator's rounding and fragmentation, cuBLAS' workspace and the decoders' tables,
  a fixed 5 % of the budget, at least 256 MiB, at most 2 GiB.

Sizes come from tensor shapes and the config, so `strata plan` prints them before loading.

`dense_forms` then decides, per dense quantized weight homed on the device, how it is held there:
its blocks (the Triton kernels multiply from them, a decode row at a time or in tiles for
prefill) or floats of the run's dtype, dequantized once at placement (cuBLAS then serves prefill)
while the budget left after the reserve and the expert cache has room. A type without a Triton
decoder is always dequantized there (else every call would dequantize it). The output head and
embedding keep their blocks: the head multiplies one row per sequence even in prefill.
"""

from __future__ import annotations

import re

from gguf import GGMLQuantizationType

from strata.formats.weights import FLOAT_TYPES

SCRATCH_MIN, SCRATCH_MAX, SCRATCH_SHARE = 256 * 2**20, 2 * 2**30, 0.05
LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def reserve(source, config, ctx: int, prefill_chunk: int, dtype_bytes: int, budget: int) -> dict[str, int]:
    """{"kv", "recurrent", "activations", "scratch"}: bytes the device keeps for each."""
    rows = _rows_by_layer(source, config.n_layers)
    kv = sum((r.get("attn_k.weight", 0) + r.get("attn_v.weight", 0)) * ctx * dtype_bytes
             + r.get("indexer.k_proj.weight", 0) * ctx * dtype_bytes for r in rows.values())
    recurrent = sum(_recurrent_bytes(config, r, dtype_bytes) for r in rows.values() if "ssm_a" in r)
    return {"kv": kv, "recurrent": recurrent, "activations": _activation_bytes(config, rows, prefill_chunk),
            "scratch": int(min(max(budget * SCRATCH_SHARE, SCRATCH_MIN), SCRATCH_MAX))}


def _rows_by_layer(source, n_layers: int) -> dict[int, dict[str, int]]:
    """Per trunk layer, each tensor's first dimension (output rows for a projection)."""
    out: dict[int, dict[str, int]] = {}
    for name in source.names():
        m = LAYER.match(name)
        if m and int(m.group(1)) < n_layers:
            shape = source.info(name)[1]
            out.setdefault(int(m.group(1)), {})[m.group(2)] = int(shape[0]) if shape else 0
    return out


def _recurrent_bytes(config, rows: dict[str, int], dtype_bytes: int) -> int:
    nv, dk, dv = (getattr(config, a, 0) for a in ("linear_v_heads", "linear_k_dim", "linear_v_dim"))
    conv_channels = rows.get("ssm_conv1d.weight", 0)
    return nv * dk * dv * 4 + 3 * conv_channels * dtype_bytes  # fp32 state; a kernel-4 conv keeps 3 inputs


def _activation_bytes(config, rows: dict[int, dict[str, int]], chunk: int) -> int:
    hidden = config.hidden_size * getattr(config, "hc_count", 1)
    widest = max((sum(r.get(n, 0) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ssm_in.weight",
                                             "attn_qkv.weight", "attn_gate.weight"))
                  for r in rows.values()), default=0)
    k = getattr(config, "n_experts_used", 0) or 1
    ffn = max(getattr(config, "expert_ffn_size", 0) * k + getattr(config, "shared_ffn_size", 0),
              getattr(config, "ffn_size", 0), 0)
    return chunk * (4 * hidden + widest + 3 * ffn) * 4


BLOCKS = "blocks"  # a dense weight's form on the device when it is not dequantized


def dense_forms(plan, source, dtype: str, room: int) -> tuple[dict[str, str], int]:
    """({name: "blocks" or the dtype it is dequantized to}, bytes the floats add over the blocks)
    for the device-homed dense quantized weights; optional dequantizing, trunk layers in order,
    within `room` bytes."""
    from strata import kernels
    from strata.kernels import gpu

    elt = {"float32": 4}.get(dtype, 2)
    experts = plan.expert_names
    grows = {}
    floats = {t.name for t in FLOAT_TYPES}
    for name, home in plan.homes.items():
        if home != "gpu" or not LAYER.match(name) or name in experts:
            continue
        kind, shape, nbytes = source.info(name)  # the stored type's name (safetensors: F32, BF16, ...)
        qtype = getattr(GGMLQuantizationType, str(kind), None)
        if len(shape) == 2 and kind not in floats and qtype is not None and kernels.has_kernel(qtype):
            grows[name] = (int(shape[0]) * int(shape[1]) * elt - nbytes, gpu.has_kernel(qtype))
    forced = {n: g for n, (g, triton) in grows.items() if not triton}
    forms, extra = dict.fromkeys(forced, dtype), sum(forced.values())
    for name, (grow, triton) in grows.items():
        if triton:
            fits = grow <= room - extra
            forms[name], extra = (dtype, extra + grow) if fits else (BLOCKS, extra)
    return forms, extra
