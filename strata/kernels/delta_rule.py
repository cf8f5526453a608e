"""One decode step of the gated delta rule in place on its state, by qmm.c's `strata_gdn_step`.

A decode token of a Gated DeltaNet layer touches its whole state (heads x d_k x d_v float32,
3 MiB a layer on Qwen3-Next-size models): torch's form (scaled copy, two batched products, a
rank-1 update) passes over it five times and allocates a new one, which the kernel maps and
zeroes page by page. The C step passes twice, each head's 64 KiB staying in L2 between the two,
and writes the state in place.

`try_gdn_step` returns None where it does not apply (kernels off or not built, not the CPU, not
float32 contiguous), and the caller keeps the torch form.

`try_gdn_prompt` runs a prompt's positions through the same recurrence in one call
(gdn_prompt.c: each value head's positions on one pool thread), where torch ran the chunked form
on one thread.
"""

from __future__ import annotations

import ctypes

import torch

from strata import kernels
from strata.kernels import _build

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P,) * 7 + (_I64,) * 3 + (ctypes.c_int,)


def _kernel():
    return _build.entry("strata_gdn_step", _ARGTYPES)


def _ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype is torch.float32 and t.is_contiguous()


def try_gdn_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """state (N, d_k, d_v) updated in place by one token (q, k (N, d_k); v (N, d_v); decay =
    exp(g) and beta (N,)); returns out (N, d_v), or None (state untouched: see the module doc)."""
    if not kernels.USE_KERNELS:
        return None
    fn = _kernel()
    if fn is None:
        return None
    n, dk, dv = state.shape
    q, k, v, decay, beta = (t.contiguous() for t in (q, k, v, decay, beta))
    if not all(_ok(t) for t in (state, q, k, v, decay, beta)):
        return None
    if q.shape != (n, dk) or k.shape != (n, dk) or v.shape != (n, dv) or decay.numel() != n or beta.numel() != n:
        return None
    out = torch.empty(n, dv)
    fn(state.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(),
       out.data_ptr(), n, dk, dv, _build.pool_threads(None))
    return out


_PROMPT_ARGTYPES = (_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _P) + (_I64,) * 6 + (ctypes.c_int,)


def _heads_ok(u: torch.Tensor, heads: int, d: int) -> bool:
    """(B, T, heads, d) float32 on the CPU, each head's d values contiguous and heads d apart."""
    return (u.device.type == "cpu" and u.dtype is torch.float32 and u.dim() == 4 and u.shape[2:] == (heads, d)
            and u.stride(3) == 1 and u.stride(2) == d)


def try_gdn_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gated delta rule over a prompt's positions, token by token (`gated_deltanet.gated_delta_rule`'s
    arguments, tokens first: q, k (B, T, H_k, d_k) before their L2 norms, v (B, T, H_v, d_v), g,
    beta (B, T, H_v), state (B, H_v, d_k, d_v), kept): (out (B, T, H_v, d_v), the new state), or
    None where it does not apply."""
    if not kernels.USE_KERNELS:
        return None
    fn = _build.entry("strata_gdn_prompt", _PROMPT_ARGTYPES, ctypes.c_int)
    if fn is None:
        return None
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if not (_heads_ok(q, hk, dk) and _heads_ok(k, hk, dk) and _heads_ok(v, hv, dv) and k.shape[:2] == (b, t)
            and v.shape[:2] == (b, t) and state.shape == (b, hv, dk, dv) and state.device.type == "cpu"):
        return None
    g, beta = (u.to(torch.float32).contiguous() for u in (g, beta))
    if g.shape != (b, t, hv) or beta.shape != (b, t, hv) or g.device.type != "cpu" or beta.device.type != "cpu":
        return None
    new = state.to(torch.float32, copy=True).contiguous()  # stepped in place: the caller's is kept
    out = torch.empty(b, t, hv, dv)
    ok = fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
            v.stride(1), g.data_ptr(), beta.data_ptr(), new.data_ptr(), out.data_ptr(), b, t, hk, hv, dk, dv,
            _build.pool_threads(None))
    return (out, new) if ok else None
