"""Layers shared by the architectures: norms, attention, dense and mixture-of-experts FFNs.

Named taps (`self.tap(name, tensor)`) carry llama.cpp's tensor names so a parity failure
can be located layer by layer against a reference dump.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from strata.models.cache import KVCache, StepInfo
from strata.models.rope import Rope
from strata.formats.weights import QTensor
from strata.kernels import decode_ops, moe
from strata.kernels.grouped import route_table
from strata.models.linear import linear_group
from strata.models.weights import WeightLoader

Tap = Callable[[str, torch.Tensor], None]


def no_tap(name: str, t: torch.Tensor) -> None:
    pass


class RMSNorm(nn.Module):
    """RMS norm in fp32; `offset=1` for the zero-centred norms some models use (weight+1)."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(weight + offset, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = decode_ops.try_rmsnorm(x, self.weight, self.eps)  # a prompt's rows: one C call
        if y is not None:
            return y
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention over a `KVCache`, with optional per-head q/k RMS norms.

    `gated=True` (Qwen3-Next): `attn_q` holds, per head, the query followed by an output gate
    of the same width, and the attention output is scaled by sigmoid(gate) before `attn_output`.
    """

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, n_heads: int, n_kv: int,
                 head_dim: int, rope: Rope, eps: float, qk_norm: bool = False, bias: bool = False,
                 gated: bool = False):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        self.gated = gated
        q_rows = n_heads * head_dim * (2 if gated else 1)

        def proj(name: str, rows: int, cols: int, with_bias: bool = False):
            return w.linear(f"{prefix}.{name}.weight", (rows, cols), f"{prefix}.{name}.bias" if with_bias else None)

        self.wq = proj("attn_q", q_rows, hidden, bias)
        self.wk = proj("attn_k", n_kv * head_dim, hidden, bias)
        self.wv = proj("attn_v", n_kv * head_dim, hidden, bias)
        self.wo = proj("attn_output", hidden, n_heads * head_dim)
        self.q_norm = RMSNorm(w.dense(f"{prefix}.attn_q_norm.weight", (head_dim,)), eps) if qk_norm else None
        self.k_norm = RMSNorm(w.dense(f"{prefix}.attn_k_norm.weight", (head_dim,)), eps) if qk_norm else None
        self.rope = rope

    def new_cache(self, kv_cache=None):
        """A `KVCache`, or what the model's KV-cache factory `kv_cache(attention)` (`Seams.kv_cache`)
        makes: the tiers' bounded device pool for --kv-device."""
        return kv_cache(self) if kv_cache is not None else KVCache()

    def forward(self, x, cache: KVCache, step: StepInfo, rope_cs, tap: Tap = no_tap):
        b, t, _ = x.shape
        q, k, v = linear_group(x, (self.wq, self.wk, self.wv))
        gate = None
        if self.gated:  # per head: [query | gate]
            q, gate = q.view(b, t, self.n_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(b, t, self.n_heads * self.head_dim)
        q = q.reshape(b, t, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = k.view(b, t, self.n_kv, self.head_dim)
        v = v.view(b, t, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope.apply(q, *rope_cs), self.rope.apply(k, *rope_cs)
        tap("Qcur", q)
        tap("Kcur", k)
        out = cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), step)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H*D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        tap("kqv_out", out)
        return self.wo(out)


class DenseFFN(nn.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x)."""

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, ffn: int, suffix: str = ""):
        super().__init__()
        self.gate = w.linear(f"{prefix}.ffn_gate{suffix}.weight", (ffn, hidden))
        self.up = w.linear(f"{prefix}.ffn_up{suffix}.weight", (ffn, hidden))
        self.down = w.linear(f"{prefix}.ffn_down{suffix}.weight", (hidden, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = linear_group(x, (self.gate, self.up))
        return self.down(F.silu(g) * u)


class SharedExpert(nn.Module):
    """An always-on SwiGLU expert beside the routed ones (`ffn_*_shexp`), scaled per token by
    sigmoid(`ffn_gate_inp_shexp` . x) when the file has that gate (Qwen2-MoE, Qwen3-Next)."""

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, ffn: int):
        super().__init__()
        self.ffn = DenseFFN(w, prefix, hidden, ffn, suffix="_shexp")
        name = f"{prefix}.ffn_gate_inp_shexp.weight"
        # (1, hidden) as the converter writes it; (hidden,) once llama-quantize has written the file
        # (ggml drops a trailing extent of 1)
        flat = w.has(name) and tuple(w.source.get(name).shape) == (hidden,)
        gate = w.optional(name, (hidden,) if flat else (1, hidden))
        self.gate = gate.reshape(1, hidden) if gate is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ffn(x)
        if self.gate is not None:
            out = torch.sigmoid(F.linear(x, self.gate)) * out
        return out


class ResidentExperts:
    """One layer's experts in memory in their stored type (`seams.Resident` makes these): the
    grouped product over them, dequantized per use or multiplied from the blocks by the kernels."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # experts resident on the device: one custom op, nothing read back
            from strata.kernels.gpu import ops  # noqa: F401  (registers torch.ops.strata.*)

            g, u, d = self.gate, self.up, self.down
            return torch.ops.strata.experts(x, ids, weights, g.raw, u.raw, d.raw,
                                            [int(g.qtype), int(u.qtype), int(d.qtype)], g.shape[2], g.shape[1])
        return moe.grouped_swiglu(x, route_table(ids, weights), (self.gate, self.up, self.down))


class Experts(nn.Module):
    """Stacked experts `[E, out, in]` behind one call: experts(x, ids, weights).

    The model's `ExpertsProvider` (`strata.models.seams`) receives them at construction and
    returns what computes them (`backend`): resident, tiered, or spread over ranks."""

    def __init__(self, w: WeightLoader, prefix: str, n_experts: int, hidden: int, ffn: int,
                 layer: int, provider):
        super().__init__()
        self.layer = layer
        self.n_experts = n_experts
        self.backend = provider.layer(
            layer, w.quantized(f"{prefix}.ffn_gate_exps.weight", (n_experts, ffn, hidden)),
            w.quantized(f"{prefix}.ffn_up_exps.weight", (n_experts, ffn, hidden)),
            w.quantized(f"{prefix}.ffn_down_exps.weight", (n_experts, hidden, ffn)))

    @property
    def overlaps(self) -> bool:
        """Whether the backend runs a `beside()` callable while its experts compute (the tiers)."""
        return getattr(self.backend, "overlaps", False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, beside=None) -> torch.Tensor:
        if beside is None:
            return self.backend(x, ids, weights)
        return self.backend(x, ids, weights, beside=beside)


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool):
    """The router: softmax over all experts, keep the top k, optionally renormalise them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)
