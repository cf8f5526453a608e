"""A trainable qwen3moe: the same math as `strata.models.qwen3moe.Model`, written for backprop.

Pre-norm blocks of RMSNorm -> grouped-query attention (per-head q/k RMS norms, NEOX rope, causal)
and RMSNorm -> mixture of SwiGLU experts behind a softmax top-k router whose top-k weights are
renormalised (`norm_topk_prob`). Parameter names map one-to-one onto llama.cpp's GGUF tensor names
(`gguf_tensors`), so the exported file loads in the engine unchanged.

Experts are stored stacked (`[E, out, in]`, as the GGUF holds them) and run grouped: tokens are
sorted by expert and each expert multiplies its own tokens in one matmul, with no capacity limit
and no dropped tokens, so training and inference route identically.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from strata.models.qwen3moe import Config


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_cos_sin(c: Config, n: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (n, 1, dim/2) for positions 0..n-1, as `strata.models.rope.Rope`."""
    d = c.rope.dim
    inv = 1.0 / (c.rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    freqs = torch.arange(n, device=device).float()[:, None] * inv
    return freqs.cos()[:, None], freqs.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """NEOX rope (halves, not interleaved pairs) over the first `dim` dims of x (B, T, H, D)."""
    rot, rest = x[..., :dim], x[..., dim:]
    x1, x2 = rot[..., : dim // 2], rot[..., dim // 2:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


class Layer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        h, hd, e, f = c.hidden_size, c.head_dim, c.n_experts, c.expert_ffn_size
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.wq = nn.Parameter(torch.empty(c.n_heads * hd, h))
        self.wk = nn.Parameter(torch.empty(c.n_kv_heads * hd, h))
        self.wv = nn.Parameter(torch.empty(c.n_kv_heads * hd, h))
        self.wo = nn.Parameter(torch.empty(h, c.n_heads * hd))
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.ffn_norm = nn.Parameter(torch.ones(h))
        self.router = nn.Parameter(torch.empty(e, h))
        self.gate = nn.Parameter(torch.empty(e, f, h))
        self.up = nn.Parameter(torch.empty(e, f, h))
        self.down = nn.Parameter(torch.empty(e, h, f))

    def attention(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        c = self.c
        b, t, _ = x.shape
        q = F.linear(x, self.wq).view(b, t, c.n_heads, c.head_dim)
        k = F.linear(x, self.wk).view(b, t, c.n_kv_heads, c.head_dim)
        v = F.linear(x, self.wv).view(b, t, c.n_kv_heads, c.head_dim)
        q, k = rms_norm(q, self.q_norm, c.rms_eps), rms_norm(k, self.k_norm, c.rms_eps)
        q, k = apply_rope(q, cos, sin, c.rope.dim), apply_rope(k, cos, sin, c.rope.dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=c.n_kv_heads != c.n_heads)
        return F.linear(out.transpose(1, 2).reshape(b, t, c.n_heads * c.head_dim), self.wo)

    def moe(self, x: torch.Tensor):
        """x (N, H) -> output (N, H), router probs (N, E), chosen ids (N, k)."""
        c = self.c
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, ids = torch.topk(probs, c.n_experts_used, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // c.n_experts_used
        counts = torch.bincount(flat, minlength=c.n_experts).tolist()
        xs = x[token_of]  # (N*k, H), grouped by expert
        # unbind once: indexing the stacked parameter per expert would make autograd build and
        # sum one full-size gradient per expert
        gates, ups, downs = self.gate.unbind(0), self.up.unbind(0), self.down.unbind(0)
        ys = []
        for e, xe in enumerate(xs.split(counts)):
            if xe.shape[0]:
                ys.append(F.linear(F.silu(F.linear(xe, gates[e])) * F.linear(xe, ups[e]), downs[e]))
        y = torch.cat(ys) * weights.reshape(-1)[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, y)
        return out, probs, ids

    def forward(self, x, cos, sin):
        x = x + self.attention(rms_norm(x, self.attn_norm, self.c.rms_eps), cos, sin)
        b, t, h = x.shape
        out, probs, ids = self.moe(rms_norm(x, self.ffn_norm, self.c.rms_eps).reshape(b * t, h))
        return x + out.view(b, t, h), probs, ids


class TrainableMoE(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.tok_embd = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.n_layers))
        self.output_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.output = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))

    def init_weights(self, generator: torch.Generator) -> None:
        """Small-normal init; output projections scaled down by depth (GPT-2 style)."""
        std = 0.02
        deep = std / math.sqrt(2 * self.c.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue
            s = deep if name.endswith(("wo", "down")) else std
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) * s)

    def forward(self, tokens: torch.Tensor, return_routing: bool = False):
        """tokens (B, T) -> logits (B, T, V), and per layer (router probs, chosen ids)."""
        cos, sin = rope_cos_sin(self.c, tokens.shape[1], tokens.device)
        x = F.embedding(tokens, self.tok_embd)
        routing = []
        for layer in self.layers:
            x, probs, ids = layer(x, cos, sin)
            routing.append((probs, ids))
        logits = F.linear(rms_norm(x, self.output_norm, self.c.rms_eps), self.output)
        return (logits, routing) if return_routing else logits

    # -- GGUF names ----------------------------------------------------------------------------------

    def gguf_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(llama.cpp tensor name, tensor) for every parameter, in torch (out, in) order."""
        out = [("token_embd.weight", self.tok_embd)]
        for i, l in enumerate(self.layers):
            p = f"blk.{i}"
            out += [(f"{p}.attn_norm.weight", l.attn_norm), (f"{p}.attn_q.weight", l.wq),
                    (f"{p}.attn_k.weight", l.wk), (f"{p}.attn_v.weight", l.wv),
                    (f"{p}.attn_output.weight", l.wo), (f"{p}.attn_q_norm.weight", l.q_norm),
                    (f"{p}.attn_k_norm.weight", l.k_norm), (f"{p}.ffn_norm.weight", l.ffn_norm),
                    (f"{p}.ffn_gate_inp.weight", l.router), (f"{p}.ffn_gate_exps.weight", l.gate),
                    (f"{p}.ffn_up_exps.weight", l.up), (f"{p}.ffn_down_exps.weight", l.down)]
        out += [("output_norm.weight", self.output_norm), ("output.weight", self.output)]
        return [(n, t.detach()) for n, t in out]

    def load_gguf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `gguf_tensors`: copy float tensors in by GGUF name."""
        params = dict(self.gguf_tensors())
        with torch.no_grad():
            for name, t in params.items():
                t.copy_(tensors[name].reshape(t.shape))


def load_balance_loss(routing, n_experts: int) -> torch.Tensor:
    """Switch Transformer auxiliary loss, averaged over layers: E * sum_e f_e * P_e.

    f_e is the fraction of routed slots that chose expert e (no gradient), P_e the mean router
    probability of e. It is 1.0 when use is uniform; larger the more skewed.
    """
    total = 0.0
    for probs, ids in routing:
        f = torch.bincount(ids.reshape(-1), minlength=n_experts).float() / ids.numel()
        total = total + n_experts * (f * probs.mean(0)).sum()
    return total / len(routing)
