"""Gated DeltaNet: the linear-attention mixer of Qwen3-Next's hybrid layers, and its recurrent cache.

Per token t and value head h, with a state S of shape (d_k, d_v):

    S <- exp(g_t) S                                   (g_t = ssm_a * softplus(alpha_t + ssm_dt) <= 0)
    S <- S + k_t (beta_t (v_t - k_t^T S))^T           (the delta rule, beta_t = sigmoid(b_t))
    o_t = q_t^T S

q, k and v come from a causal depthwise conv (kernel K, then SiLU) over the `attn_qkv`
projection; q and k are L2-normalised and q is scaled by d_k^-1/2. The output is RMS-normed per
head, multiplied by silu(z) (`attn_gate`), and projected by `ssm_out`.

Prefill runs the chunked form (`chunk_gated_delta_rule`: within a chunk, the delta rule as one
triangular solve; across chunks, the state), or on the CPU the recurrence over all positions in
one C call (`kernels.delta_rule.try_gdn_prompt`); decode runs the one-step recurrence. The conv keeps
a rolling state of each row's last K-1 inputs, so decode needs no convolution call.

Right padding: rows of a batch may carry fewer real tokens than the step's width. Padded
positions get beta = 0 and g = 0 (the state passes through unchanged), and each row's conv state
is taken from its own last real inputs, so padding never reaches a row's cache.

Weights (llama.cpp's names, `blk.N.` prefix): `attn_qkv` (conv channels: all q heads, all k heads,
all v heads), `attn_gate` (z), or the legacy fused `ssm_in` (HF's `in_proj_qkvz`, grouped per key
head) split here at load; `ssm_ba` (HF's `in_proj_ba`, per key head [beta x r, alpha x r]);
`ssm_conv1d` (conv_dim, K); `ssm_dt.bias`; `ssm_a` (= -exp(A_log)); `ssm_norm`; `ssm_out`.
Qwen3.5-style files carry `ssm_beta` and `ssm_alpha` (value-head order) in place of `ssm_ba`;
`gate_act` picks the output gate's activation (silu for Qwen3-Next, sigmoid for qwen4exp).
"""

from __future__ import annotations

from typing import NamedTuple

import math

import torch
import torch.nn.functional as F
from torch import nn

from strata import kernels
from strata.kernels.causal_conv import try_causal_conv
from strata.kernels.delta_rule import try_gdn_prompt, try_gdn_step
from strata.kernels.threads import one_thread_if_small
from strata.models.cache import StepInfo
from strata.models.linear import apply_linear
from strata.models.weights import WeightLoader


class GDNCache:
    """One Gated DeltaNet layer's per-row state: the conv window and the delta-rule state.

    `conv` is (B, K-1, conv_dim): each row's last K-1 conv inputs, oldest first (zeros before
    the first token). `state` is (B, H_v, d_k, d_v), fp32. Both are created by the first forward.
    """

    # A tracked forward of T positions keeps the state after each (the recurrence makes each one
    # anyway; keeping them costs memory, not time) while they take at most this many bytes, so a
    # rollback picks one instead of replaying the recurrence (vLLM keeps its Mamba layers'
    # per-draft states alike); a larger batch replays.
    STEP_BYTES = 64 << 20

    def __init__(self):
        self.conv: torch.Tensor | None = None
        self.state: torch.Tensor | None = None
        self.tracking = False  # speculative decoding: keep what `rollback` needs
        self.pending: _Undo | None = None  # the last tracked forward's inputs
        self.window: torch.Tensor | None = None  # its conv inputs, while tracking

    def ensure(self, batch: int, kernel: int, channels: int, heads: int, dk: int, dv: int,
               dtype: torch.dtype, device=None) -> None:
        if self.conv is None:
            self.conv = torch.zeros(batch, kernel - 1, channels, dtype=dtype, device=device)
            self.state = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device)

    def select(self, rows: torch.Tensor) -> None:
        if self.conv is not None:
            self.conv, self.state = self.conv[rows], self.state[rows]

    def extend(self, other: "GDNCache") -> None:
        """Append `other`'s rows after these (see `KVCache.extend`); states are fixed-size."""
        if other.conv is None:
            return
        if self.conv is None:
            self.conv, self.state = other.conv, other.state
            return
        self.conv = torch.cat([self.conv, other.conv])
        self.state = torch.cat([self.state, other.state])

    @property
    def nbytes(self) -> int:
        return 0 if self.conv is None else self.conv.nbytes + self.state.nbytes

    def track(self, on: bool = True) -> None:
        """Speculative decoding: each forward from now on runs the token-by-token recurrence
        (a decode step's arithmetic, so a verify pass matches plain decoding) and keeps its
        starting state, its delta-rule inputs and its conv window, so `rollback` can restore
        the state after any prefix of it."""
        self.tracking = on
        self.pending = None

    def keep_undo(self, start: torch.Tensor, window: torch.Tensor, n_new: torch.Tensor, steps: list[torch.Tensor]) -> None:
        """A tracked forward made elsewhere (the C decode half, `kernels.decode_ops`): its
        starting state, conv window, real tokens per row and the state after each position, so
        `rollback` picks one as it does after the torch form's."""
        self.window = window
        self.pending = _Undo(start, None, None, None, None, None, window, n_new, steps)

    def rollback(self, n_drop) -> None:
        """Undo the last `n_drop` real tokens of the last (tracked) forward: the state becomes
        the one that forward held after each row's kept tokens (kept while it ran, `STEP_BYTES`),
        else it is recomputed from the forward's start over the kept tokens only (dropped steps
        get g = beta = 0, which leaves the state exactly as it was); the conv window is re-read
        at the kept end."""
        p = self.pending
        if p is None:
            raise ValueError("GDNCache.rollback needs track() on before the forward it undoes")
        keep = p.n_new - torch.as_tensor(n_drop, device=p.n_new.device)  # (B,): one count, or one per row
        if bool((keep < 0).any()):
            raise ValueError(f"cannot drop {n_drop} tokens from a forward of {p.n_new.tolist()}")
        if p.steps is not None:
            after = [p.state, *p.steps]  # after[j]: the state after j tokens
            if keep.device.type == "cpu":
                counts = keep.tolist()
                self.state = after[counts[0]] if len(set(counts)) == 1 else \
                    torch.stack([after[j][row] for row, j in enumerate(counts)])
            else:  # a gather: nothing read back
                self.state = torch.stack(after)[keep, torch.arange(len(keep), device=keep.device)]
        else:
            kept = (torch.arange(p.g.shape[1], device=keep.device)[None, :] < keep[:, None])[..., None]
            _, self.state = gated_delta_rule(p.q, p.k, p.v, p.g * kept, p.beta * kept, p.state, recurrent=True)
        idx = keep[:, None] + torch.arange(self.conv.shape[1], device=keep.device)
        self.conv = p.window.gather(1, idx[..., None].expand(-1, -1, p.window.shape[2]))
        self.pending = p._replace(n_new=keep)


class _Undo(NamedTuple):
    """A tracked forward, as `GDNCache.rollback` replays it."""

    state: torch.Tensor  # the state before the forward
    q: torch.Tensor | None  # the replay's inputs (None when `steps` holds every state: the C half's)
    k: torch.Tensor | None
    v: torch.Tensor | None
    g: torch.Tensor | None  # padding already zeroed
    beta: torch.Tensor | None
    window: torch.Tensor  # (B, K-1+T, C): the conv state, then this forward's conv inputs
    n_new: torch.Tensor  # (B,) real tokens per row
    steps: list[torch.Tensor] | None  # the state after each position (None: over `STEP_BYTES`)


def split_ssm_in(qkvz: torch.Tensor, n_k_heads: int, n_v_heads: int, dk: int, dv: int):
    """HF's `in_proj_qkvz` (llama.cpp's legacy `ssm_in`), rows grouped per key head as
    [q (dk), k (dk), v (r*dv), z (r*dv)], into (`attn_qkv`, `attn_gate`) rows: all q heads,
    all k heads, all v heads; and z. The same split llama.cpp's converter does."""
    r = n_v_heads // n_k_heads
    grouped = qkvz.reshape(n_k_heads, 2 * dk + 2 * r * dv, *qkvz.shape[1:])
    q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], dim=1)
    flat = [t.reshape(-1, *qkvz.shape[1:]) for t in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer; called like `Attention` (x, cache, step, rope_cs, tap)."""

    def __init__(self, w: WeightLoader, prefix: str, hidden: int, n_k_heads: int, n_v_heads: int,
                 dk: int, dv: int, kernel: int, eps: float, chunk: int = 64, gate_act: str = "silu"):
        super().__init__()
        self.gate_act = gate_act
        if n_v_heads % n_k_heads:
            raise ValueError(f"{n_v_heads} value heads are not a multiple of {n_k_heads} key heads")
        self.nk, self.nv, self.dk, self.dv = n_k_heads, n_v_heads, dk, dv
        self.kernel, self.eps, self.chunk = kernel, eps, chunk
        self.key_dim, self.value_dim = n_k_heads * dk, n_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        p = prefix
        if w.has(f"{p}.attn_qkv.weight"):
            self.wqkv = w.linear(f"{p}.attn_qkv.weight", (self.conv_dim, hidden))
            self.wz = w.linear(f"{p}.attn_gate.weight", (self.value_dim, hidden))
        else:  # legacy GGUF / HF checkpoints: one fused projection, grouped per key head
            fused = w.linear(f"{p}.ssm_in.weight", (self.conv_dim + self.value_dim, hidden))
            self.wqkv, self.wz = fused.split_rows(lambda rows: split_ssm_in(rows, n_k_heads, n_v_heads, dk, dv))
        r = n_v_heads // n_k_heads
        if w.has(f"{p}.ssm_beta.weight"):  # Qwen3.5 layout: two tensors, value-head order
            self.wb = w.linear(f"{p}.ssm_beta.weight", (n_v_heads, hidden))
            self.wa = w.linear(f"{p}.ssm_alpha.weight", (n_v_heads, hidden))
        else:  # rows per key head: [beta (r) | alpha (r)]; split by rows, so blocks stay blocks
            ba = w.linear(f"{p}.ssm_ba.weight", (2 * n_v_heads, hidden))
            self.wb, self.wa = ba.split_rows(
                lambda rows: [rows.reshape(n_k_heads, 2, r, -1)[:, j].reshape(n_v_heads, -1) for j in (0, 1)])
        self.conv_w = w.dense(f"{p}.ssm_conv1d.weight", (self.conv_dim, kernel))
        self.dt_bias = w.dense(f"{p}.ssm_dt.bias", (n_v_heads,)).float()
        self.a = w.dense(f"{p}.ssm_a", (n_v_heads,)).float()  # -exp(A_log)
        self.norm = w.dense(f"{p}.ssm_norm.weight", (dv,))
        self.wo = w.linear(f"{p}.ssm_out.weight", (hidden, self.value_dim))

    def new_cache(self, kv_cache=None) -> GDNCache:  # a recurrent state: no KV
        return GDNCache()

    def forward(self, x: torch.Tensor, cache: GDNCache, step: StepInfo, rope_cs=None, tap=None):
        b, t, _ = x.shape
        cache.ensure(b, self.kernel, self.conv_dim, self.nv, self.dk, self.dv, x.dtype, x.device)
        real = step.token_mask.to(x.device, non_blocking=True)  # (B, T)
        qkv = F.silu(self._conv(apply_linear(x, self.wqkv), cache, step.n_new.to(x.device, non_blocking=True)), inplace=True)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.nk, self.dk)
        k = k.reshape(b, t, self.nk, self.dk)
        v = v.reshape(b, t, self.nv, self.dv)
        beta = torch.sigmoid(F.linear(x, self.wb).float())  # (B, T, H_v)
        g = self.a * F.softplus(F.linear(x, self.wa).float() + self.dt_bias)
        keep = real[..., None]
        beta, g = beta * keep, g * keep  # padding: no write, no decay
        start = cache.state
        steps = [] if cache.tracking and t * start.nbytes <= cache.STEP_BYTES else None
        out, cache.state = gated_delta_rule(q, k, v, g, beta, start, self.chunk, recurrent=cache.tracking, steps=steps,
                                            in_place=not cache.tracking)
        if cache.tracking:
            cache.pending = _Undo(start, q, k, v, g, beta, cache.window, step.n_new.to(x.device, non_blocking=True),
                                  steps)
        z = apply_linear(x, self.wz).reshape(b, t, self.nv, self.dv)
        out = gated_rms_norm(out.to(x.dtype), z, self.norm, self.eps, self.gate_act)
        if tap is not None:
            tap("final_output", out)  # llama.cpp's name: gated-normed, before ssm_out
        return apply_linear(out.reshape(b, t, self.value_dim), self.wo)

    def _conv(self, x: torch.Tensor, cache: GDNCache, n_new: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv of (B, T, C) over [conv state, x]; keeps each row's last K-1
        real inputs as its new state. One multiply-add per tap; decode (T=1) is one window."""
        t = x.shape[1]
        full = torch.cat([cache.conv.to(x.dtype), x], dim=1)  # (B, K-1+T, C)
        out = try_causal_conv(full, self.conv_w)  # the C form, else torch's, tap by tap in place
        if out is None:
            out = full[:, 0:t] * self.conv_w[:, 0]
            for j in range(1, self.kernel):  # in place: a prompt's (T, C) temporaries cost more than the taps
                out.addcmul_(full[:, j:j + t], self.conv_w[:, j])
        # row b's last K-1 real inputs sit at full[b, n_b : n_b + K-1]
        idx = n_new[:, None] + torch.arange(self.kernel - 1, device=x.device)
        cache.conv = full.gather(1, idx[..., None].expand(-1, -1, full.shape[2]))
        cache.window = full if cache.tracking else None
        return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   act: str = "silu") -> torch.Tensor:
    """RMS norm over each head's d_v (fp32), times weight, times silu(z) (or sigmoid(z))."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gate = torch.sigmoid(z.float()) if act == "sigmoid" else F.silu(z.float())
    out = (weight * xf.to(x.dtype)) * gate
    return out.to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6, scale: float | None = None) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (transformers' l2norm); with `scale`, times it in
    the same pass (the prefill's form)."""
    inv = torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
    return x * (inv if scale is None else inv * scale)


def gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64, recurrent: bool = False, steps: list | None = None,
                     in_place: bool = False):
    """q, k (B, T, H_k, d_k); v (B, T, H_v, d_v); g, beta (B, T, H_v); state (B, H_v, d_k, d_v).

    Returns the output (B, T, H_v, d_v) fp32 and the new state. Key heads are shared by
    H_v / H_k consecutive value heads. One token runs the recurrence, more run in chunks
    (unless `recurrent`: a speculative verify pass runs its few tokens one by one, and `steps`,
    a list, receives the state after each of them). With `in_place`, a one-token step may
    write the new state into `state` (a cache's own, which nothing else keeps).
    """
    scale = q.shape[-1] ** -0.5
    if q.shape[1] > 1 and not recurrent:
        done = try_gdn_prompt(q, k, v, g, beta, state)  # on the CPU: token by token in C, heads over the pool
        if done is not None:
            return done
        # the chunked form shares each key head's products across its value heads
        q, k, v, g, beta = (u.transpose(1, 2).float() for u in (q, k, v, g, beta))  # heads first
        # a prompt shorter than a chunk pads only to a multiple of 8: an 8-token prompt padded to 64
        # cost 8x the products (70 ms a layer of qwen4exp's shapes, against 9)
        chunk = min(chunk, -(-q.shape[2] // 8) * 8)
        # on one torch thread: at 2 its ~40 small ops each wait at a barrier (pp512 layer, load 8: 0.59 s CPU, 0.11 on 1)
        with one_thread_if_small(0, q.device):
            out, state = chunk_gated_delta_rule(l2norm(q, scale=scale), l2norm(k), v, g, beta, state, chunk)
        return out.transpose(1, 2), state
    r = v.shape[2] // q.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    q, k, v, g, beta = (u.transpose(1, 2).float() for u in (q, k, v, g, beta))  # heads first
    q, k = l2norm(q), l2norm(k)
    q = q * scale
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, state, steps, in_place)
    return out.transpose(1, 2), state


def recurrent_gated_delta_rule(q, k, v, g, beta, state, steps: list | None = None, in_place: bool = False):
    """Token by token; q, k (B, H, T, d_k), v (B, H, T, d_v), g, beta (B, H, T).

    With d = exp(g) the step is S' = d S + k (x) delta, delta = (v - k^T (d S)) beta, out = q^T S'.
    On the CPU each step is one C call (`kernels.delta_rule`: two passes over the state, written
    in place; into a copy unless `in_place`, and a copy per step when `steps` keeps them all);
    else batched products over the (d_k x d_v) state, four passes over it per token (a scaled
    copy, two reads, one rank-1 update in place), in the order of operations of the reference
    (transformers' recurrent step). Both are bound by the state's memory traffic."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    bh = b * h
    out = torch.empty_like(v)
    state = state.reshape(bh, dk, dv)
    c_step = kernels.USE_KERNELS and state.device.type == "cpu"  # else no copy for a C step that cannot run
    for i in range(t):
        q_i, k_i = q[:, :, i].reshape(bh, dk), k[:, :, i].reshape(bh, dk)
        decay = g[:, :, i].exp().reshape(bh, 1)
        o = None
        if c_step:
            new = state if in_place and steps is None else state.clone()
            o = try_gdn_step(new, q_i, k_i, v[:, :, i].reshape(bh, dv), decay, beta[:, :, i].reshape(bh))
            c_step = o is not None  # what declines one step declines them all
        if o is not None:
            state, in_place = new, True  # the copy is this call's own from here on
            out[:, :, i] = o.reshape(b, h, dv)
            if steps is not None:
                steps.append(state.reshape(b, h, dk, dv))
            continue
        state = state * decay[..., None]
        delta = (v[:, :, i].reshape(bh, dv) - torch.bmm(k_i[:, None], state)[:, 0]) * beta[:, :, i].reshape(bh, 1)
        state.baddbmm_(k_i[:, :, None], delta[:, None, :])
        out[:, :, i] = torch.bmm(q_i[:, None], state).reshape(b, h, dv)
        if steps is not None:  # each step's state is a tensor of its own: the next step makes a new one
            steps.append(state.reshape(b, h, dk, dv))
    return out, state.reshape(b, h, dk, dv)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64):
    """The same recurrence, `chunk` tokens at a time: q, k (B, H_k, T, d_k), v (B, H_v, T, d_v),
    g, beta (B, H_v, T), H_v a multiple of H_k (consecutive value heads share a key head).

    Within a chunk, with cumulative log-decay G_i, the delta rule's writes solve the unit lower
    triangular system (I + tril(diag(beta) K K^T * exp(G_i - G_j), -1)) U = [beta V | beta K exp(G)];
    the state then carries one chunk to the next. Q K^T is taken once per key head (diag(beta) K K^T
    per value head, in transformers' order: this sum's rounding reaches the logits on
    ill-conditioned prompts). Everything is laid out chunk first, so the loop over chunks runs
    three batched products and one in-place update per chunk on contiguous slices; the solve
    runs once, in place, on column-major right-hand sides (LAPACK's order: no copies).
    """
    b, hk, t, dk = k.shape
    hv, dv = v.shape[1], v.shape[-1]
    r = hv // hk
    pad = (-t) % chunk
    if pad:  # padded steps have g = beta = 0: no write, no decay
        q, k, v = (F.pad(u, (0, 0, 0, pad)) for u in (q, k, v))
        g, beta = (F.pad(u, (0, pad)) for u in (g, beta))
    n = (t + pad) // chunk

    def chunks_first(u):  # (B, H, n*C, ...) -> (n, B, H, C, ...), contiguous
        u = u.reshape(b, u.shape[1], n, chunk, *u.shape[3:])
        return u.permute(2, 0, 1, *range(3, u.dim())).contiguous()

    def per_key(u):  # (n, B, H_v, ...) -> (n, B, H_k, r, ...): a key head's value heads
        return u.reshape(n, b, hk, r, *u.shape[3:])

    q, k, v, g, beta = (chunks_first(u) for u in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # (n, B, H_v, C)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # Decay factors under exp(floor) (float32: 1.5e-19) are dropped (0), not left subnormal: a strongly
    # decaying head's factors underflow, and arithmetic on subnormals runs many times slower on x86
    # (a random-weight qwen3-next layer's pp512: the whole rule 3x slower).
    floor = math.log(torch.finfo(q.dtype).tiny) + 44.0

    def decay_of(log_decay):  # exp, with the factors under exp(floor) zero
        return log_decay.masked_fill(log_decay < floor, float("-inf")).exp_()

    decay = decay_of((cum[..., :, None] - cum[..., None, :]).masked_fill_(upper, float("-inf")))
    cum_decay = decay_of(cum)
    kt = k.transpose(-1, -2)
    # only the strict lower triangle is read: the solver takes the diagonal as ones
    k_beta = k[:, :, :, None] * per_key(beta)[..., None]  # (n, B, H_k, r, C, d_k)
    gram = k_beta.reshape(n, b, hk, r * chunk, dk) @ kt  # a key head's value heads stacked: one product
    system = gram.reshape(n, b, hk, r, chunk, chunk).mul_(per_key(decay)).reshape(n, b, hv, chunk, chunk)
    rhs = torch.empty(n, b, hv, dv + dk, chunk, dtype=q.dtype, device=q.device).transpose(-1, -2)
    torch.mul(v, beta[..., None], out=rhs[..., :dv])
    torch.mul(k[:, :, :, None], per_key(beta * cum_decay)[..., None], out=per_key(rhs[..., dv:]))
    # on one thread: torch's batched triangular solve (MKL) at 2 threads on a shared machine took
    # 34 ms to 1.5 s for a 512-token qwen3-next layer's 256 systems, on one 3-7 ms
    with one_thread_if_small(0, q.device):
        uw = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True, out=rhs)
    u, w = uw[..., :dv], uw[..., dv:]
    # w's row i is exp(G_i) times an O(1) row (the solve's decays factor so): where that factor
    # was dropped, the row is zero too, not a sum of subnormal products
    w = w.masked_fill_((cum_decay == 0)[..., None], 0.0).reshape(n, b * hv, chunk, dk)
    scores = (per_key(decay) * (q @ kt)[:, :, :, None]).reshape(n, b * hv, chunk, chunk)  # causal, diagonal included
    q_decayed = (q[:, :, :, None] * per_key(cum_decay)[..., None]).reshape(n, b * hv, chunk, dk)
    k_decayed = (k[:, :, :, None] * per_key(decay_of(cum[..., -1:] - cum))[..., None]).reshape(n, b * hv, chunk, dk)
    chunk_decay = cum_decay[..., -1].reshape(n, b * hv, 1, 1)
    u = u.reshape(n, b * hv, chunk, dv)

    state = state.float().reshape(b * hv, dk, dv).clone()  # updated in place below; the caller's is kept
    out = torch.empty(n, b * hv, chunk, dv, dtype=q.dtype, device=q.device)
    for i in range(n):
        v_new = torch.baddbmm(u[i], w[i], state, alpha=-1)
        torch.bmm(q_decayed[i], state, out=out[i]).baddbmm_(scores[i], v_new)
        state.mul_(chunk_decay[i]).baddbmm_(k_decayed[i].transpose(-1, -2), v_new)
    # tokens first in memory (what the caller's norm and ssm_out read), returned heads first
    out = out.reshape(n, b, hv, chunk, dv).permute(1, 0, 3, 2, 4).reshape(b, n * chunk, hv, dv)
    return out[:, :t].transpose(1, 2), state.reshape(b, hv, dk, dv)
