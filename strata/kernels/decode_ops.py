"""The small operations of a decode step in one C call each (qmm.c): the rotary embedding, a
projection group (q/k/v, gate/up) multiplied by its quantized weights in one trip, and a decode
token's layer halves (attention, dense FFN, MoE: each with its RMS norm and residual).

On a decode token a layer was ~180 torch operators at 3-5 us each, more time than the kernels on
a small model (bench/decode_profile.py). torch.compile of a norm + rope segment measured 54 us per
call against 86 us eager (its wrapper's own cost), after 61 s of compiling; these calls take a few
microseconds. The layer halves' RMS norm sums its squares in order, not in torch's order (a rounding
difference: tests/test_decode_ops.py checks each half against the torch modules).
Two serve prompts too: `try_rope` at any size, and `try_rmsnorm` only above DECODE_MAX values (a
prompt's norm; the decode halves norm their own token). Each `try_*` returns None when it does not
apply (not float32 on the CPU, a size it does not take, kernels unavailable or off), and the caller
runs torch.
"""

from __future__ import annotations

import ctypes

import torch

from strata import kernels
from strata.formats.weights import QTensor
from strata.kernels import _build

# Above this many values torch's own (threaded, vectorised) operators win: prompts.
DECODE_MAX = 1 << 16


def _ok(x: torch.Tensor, any_size: bool = False) -> bool:
    return (kernels.USE_KERNELS and x.dtype is torch.float32 and x.device.type == "cpu"
            and (any_size or x.numel() <= DECODE_MAX) and x.is_contiguous())


def try_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, interleaved: bool) -> torch.Tensor | None:
    """x (B, T, H, D) rotated on its first `rot` values by cos/sin (B, T, 1, rot/2), or None. Any
    number of tokens: for a prompt too the one C pass beats torch's six operators (512 x 32 x 128,
    1 thread: 1.6 against 8 ms wall; 2 threads on a loaded machine: 2.6 against 89 ms)."""
    lib = _build.load()
    if lib is None or not _ok(x, any_size=True) or x.dim() != 4 or cos.dtype is not torch.float32:
        return None
    b, t, h, d = x.shape
    if cos.shape != (b, t, 1, rot // 2) or sin.shape != cos.shape or rot > d:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    lib.strata_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), b * t, h, d, rot, int(interleaved), out.data_ptr())
    return out


def try_qmatmul_group(x: torch.Tensor, weights: tuple[QTensor, ...],
                      biases: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor] | None:
    """[x @ W_j.T + bias_j] for a group of weights sharing x, in one C call, or None (a weight
    without an own kernel, a ggml-only type, not a decode-sized float32 x on the CPU)."""
    lib = _build.load()
    if lib is None or not _ok(x):
        return None
    cols = x.shape[-1]
    rows_x = x.numel() // cols if cols else 0
    if not 0 < rows_x <= kernels.FAST_BATCH_MAX:
        return None
    plans = [kernels._plan(w) for w in weights]
    if any(p is None or p.fnptr is None or p.cols != cols for p in plans):
        return None
    for bias, p in zip(biases, plans):
        if bias is not None and (bias.dtype is not torch.float32 or bias.numel() != p.rows or not bias.is_contiguous()):
            return None
    n = len(plans)
    rows = [p.rows for p in plans]
    out = torch.empty(*x.shape[:-1], sum(rows))
    scratch = torch.empty(rows_x * max(rows)) if rows_x > 1 else out
    lib.strata_qmm_group(n, (ctypes.c_void_p * n)(*(p.fnptr for p in plans)), (ctypes.c_void_p * n)(*(p.ptr for p in plans)),
                         (ctypes.c_int64 * n)(*rows), cols, x.data_ptr(), rows_x,
                         (ctypes.c_void_p * n)(*(0 if bi is None else bi.data_ptr() for bi in biases)),
                         out.data_ptr(), scratch.data_ptr(), _build.pool_threads(None))
    parts = out.split(rows, dim=-1)
    return list(parts) if rows_x == 1 else [t.contiguous() for t in parts]


def _linear_plan(lin):
    """The kernel plan of a Linear's quantized weight on the CPU (with its own C kernel), or None."""
    w = getattr(lin, "weight", None)
    if not isinstance(w, QTensor) or w.raw.device.type != "cpu":
        return None
    p = kernels._plan(w)
    return p if p is not None and p.fnptr is not None else None


def _vec(t) -> bool:
    return t is not None and t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def attention_parts(norm, attn, hidden: int):
    """(plans of q, k, v, o; the q/k/v biases; the q and k norms; the rotary width) of an attention
    half a decode token can run in one C call (strata_attn_decode), or None where it does not apply
    (a biased output, a weight without an own kernel, shapes that do not chain): the checks
    `try_attention_block` and decode_stack share."""
    plans = [_linear_plan(lin) for lin in (attn.wq, attn.wk, attn.wv, attn.wo)]
    if any(p is None for p in plans) or attn.wo.bias is not None:
        return None
    pq, pk, pv, po = plans
    hq, hkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    q_rows = hq * d * (2 if attn.gated else 1)  # gated: per head, the query then its gate
    if (pq.rows, pk.rows, pv.rows, po.rows, po.cols) != (q_rows, hkv * d, hkv * d, hidden, hq * d) or hq % hkv:
        return None
    if pq.cols != hidden or pk.cols != hidden or pv.cols != hidden:
        return None
    biases = (attn.wq.bias, attn.wk.bias, attn.wv.bias)
    if any(b is not None and not (_vec(b) and b.numel() == r) for b, r in zip(biases, (pq.rows, pk.rows, pv.rows))):
        return None
    qn, kn = attn.q_norm, attn.k_norm
    if (qn is None) != (kn is None) or (qn is not None and not (_vec(qn.weight) and _vec(kn.weight)
                                                              and qn.weight.numel() == d and kn.weight.numel() == d)):
        return None
    rot = attn.rope.cfg.dim
    if not _vec(norm.weight) or norm.weight.numel() != hidden or rot > d:
        return None
    return plans, biases, qn, kn, rot


def try_attention_block(x: torch.Tensor, norm, attn, cache, step, rope_cs) -> torch.Tensor | None:
    """x + attn(norm(x)) for one decode token in one C call (strata_attn_decode: norm, q/k/v, q/k
    norms, rope, the KV write, attention, Qwen3-Next's sigmoid output gate, output projection,
    residual), or None where it does not apply (not one float32 token of one row on the CPU, a
    biased output, another cache, a weight without an own kernel). The caller checks the module types."""
    lib = _build.load()
    if lib is None or not _ok(x) or x.shape[0] != 1 or x.shape[1] != 1:
        return None
    hidden = x.shape[-1]
    parts = attention_parts(norm, attn, hidden)
    if parts is None:
        return None
    plans, biases, qn, kn, rot = parts
    pq, pk, pv, po = plans
    hq, hkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    cos, sin = rope_cs
    if not (_vec(cos) and _vec(sin)) or cos.numel() != rot // 2 or sin.numel() != rot // 2:
        return None
    if cache.k is not None and (cache.k.dtype is not torch.float32 or cache.k.device.type != "cpu"
                                or cache.k.shape[0] != 1 or cache.k.shape[1] != hkv or cache.k.shape[3] != d):
        return None
    if step.start.numel() != 1 or int(step.n_new[0]) != 1:
        return None
    pos = int(step.start[0])
    if cache.k is None or pos + 1 > cache.k.shape[2]:  # the cache grows: else _reserve has nothing to do
        like = x.new_empty(1, 1, 1, d)  # what _reserve reads: dtype, device and head_dim
        cache._reserve(1, hkv, pos + 1, like, like)
    kc, vc = cache.k, cache.v
    if not (kc.is_contiguous() and vc.is_contiguous()):
        return None
    out = torch.empty_like(x)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    ok = lib.strata_attn_decode(
        x.data_ptr(), hidden, norm.weight.data_ptr(), ctypes.c_float(norm.eps),
        (vp * 3)(pq.fnptr, pk.fnptr, pv.fnptr), (vp * 3)(pq.ptr, pk.ptr, pv.ptr), (i64 * 3)(pq.rows, pk.rows, pv.rows),
        (vp * 3)(*(0 if b is None else b.data_ptr() for b in biases)), hq, hkv, d,
        qn.weight.data_ptr() if qn is not None else None, kn.weight.data_ptr() if kn is not None else None,
        ctypes.c_float(qn.eps if qn is not None else 0.0), cos.data_ptr(), sin.data_ptr(), rot,
        int(attn.rope.cfg.interleaved), kc.data_ptr(), vc.data_ptr(), kc.shape[2], pos, po.fnptr, po.ptr,
        int(attn.gated), out.data_ptr(), _build.pool_threads(None))
    return out if ok else None


def _swiglu_plans(ffn, hidden: int):
    """The gate, up and down plans of a bias-free SwiGLU FFN over `hidden`, or None where its
    products have no own kernel or its shapes do not chain."""
    lins = (ffn.gate, ffn.up, ffn.down)
    plans = [_linear_plan(lin) for lin in lins]
    if any(p is None for p in plans) or any(lin.bias is not None for lin in lins):
        return None
    g, u, d = plans
    if (g.cols, u.rows, u.cols, d.rows, d.cols) != (hidden, g.rows, hidden, hidden, g.rows):
        return None
    return plans


def try_ffn_block(h: torch.Tensor, norm, ffn) -> torch.Tensor | None:
    """h + ffn(norm(h)) of a dense SwiGLU FFN for one decode token in one C call (strata_ffn_decode),
    or None where it does not apply (as `try_attention_block`)."""
    lib = _build.load()
    if lib is None or not _ok(h) or h.numel() != h.shape[-1]:
        return None
    hidden = h.shape[-1]
    plans = _swiglu_plans(ffn, hidden)
    if plans is None or not _vec(norm.weight) or norm.weight.numel() != hidden:
        return None
    pg, pu, pd = plans
    f = pg.rows
    out = torch.empty_like(h)
    vp = ctypes.c_void_p
    ok = lib.strata_ffn_decode(h.data_ptr(), hidden, norm.weight.data_ptr(), ctypes.c_float(norm.eps),
                               (vp * 2)(pg.fnptr, pu.fnptr), (vp * 2)(pg.ptr, pu.ptr), f, pd.fnptr, pd.ptr,
                               out.data_ptr(), _build.pool_threads(None))
    return out if ok else None


def try_moe_block(h: torch.Tensor, norm, moe, k: int, normalize: bool) -> torch.Tensor | None:
    """h + moe(norm(h)) for one decode token in one C call (strata_moe_decode: norm, the float32
    router, softmax top-k, the resident stacked experts, a shared expert and its sigmoid gate), or None where it does not apply (not one
    float32 token on the CPU, a router or experts elsewhere, a type without an own kernel). The
    caller checks the module types and that the router's rule is `softmax_topk(k, normalize)`."""
    lib = _build.load()
    if lib is None or not _ok(h) or h.numel() != h.shape[-1]:
        return None
    hidden = h.shape[-1]
    router = moe.router
    if not _vec(router) or router.dim() != 2 or router.shape[1] != hidden or not _vec(norm.weight):
        return None
    backend = moe.experts.backend
    stacked = (backend.gate, backend.up, backend.down)
    plans = kernels.stacked_plans(stacked, hidden)
    n_exp = router.shape[0]
    if plans is None or stacked[0].shape[0] != n_exp or not 0 < k <= n_exp:
        return None
    (g0, gs), (u0, us), (d0, ds) = plans
    ffn = g0.rows
    vp = ctypes.c_void_p
    sh_fns = sh_w = sh_gate = None
    sh_ffn = 0
    if moe.shared is not None:  # a SharedExpert (the caller checks the type): its DenseFFN and gate row
        sp = _swiglu_plans(moe.shared.ffn, hidden)
        if sp is None:
            return None
        sg, su, sd = sp
        sh_ffn = sg.rows
        gate = moe.shared.gate
        if gate is not None:
            if not _vec(gate) or gate.numel() != hidden:
                return None
            sh_gate = gate.data_ptr()
        sh_fns, sh_w = (vp * 3)(sg.fnptr, su.fnptr, sd.fnptr), (vp * 3)(sg.ptr, su.ptr, sd.ptr)
    out = torch.empty_like(h)
    ids, weights = (ctypes.c_int64 * k)(), (ctypes.c_float * k)()
    ok = lib.strata_moe_decode(h.data_ptr(), hidden, norm.weight.data_ptr(), ctypes.c_float(norm.eps), router.data_ptr(),
                               n_exp, k, int(normalize), g0.ptr, gs, u0.ptr, us, d0.ptr, ds, g0.fnptr, u0.fnptr, d0.fnptr,
                               ffn, sh_fns, sh_w, sh_ffn, sh_gate, ids, weights, out.data_ptr(), _build.pool_threads(None))
    return out if ok else None


_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_GDN_ARGTYPES = (_P, _I64, _I64, _P, _I64, _P, _F32, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P,
                 _P, _P, _F32, _INT, _P, _P, _P, _INT, _P, _INT)


class _GDNArgs:
    """What strata_gdn_decode reads of one GatedDeltaNet (and its input norm, if any), built once:
    its weights' kernel plans (kept: a plan may own the bytes it points to) as ctypes arrays, the
    conv taps tap-major, and ssm_out's input order (qwen4exp's tiled value heads: an
    `InputPermutedLinear`), int64. `of` names the activation mode, tensors and linears it was built
    from; a layer whose weights were replaced or moved, or another mode, builds a new one."""

    __slots__ = ("of", "plans", "fns", "ws", "rows", "taps", "order")

    def __init__(self, of, plans, taps, order):
        self.of, self.plans, self.taps, self.order = of, plans, taps, order
        self.fns = (_P * 4)(*(p.fnptr for p in plans[:4]))
        self.ws = (_P * 4)(*(p.ptr for p in plans[:4]))
        self.rows = (_I64 * 4)(*(p.rows for p in plans[:4]))


def _gdn_order(wo, value_dim: int) -> torch.Tensor | None | bool:
    """ssm_out's input order as a contiguous int64 permutation (None: its own order), or False
    where it is not one (what the C half cannot take)."""
    order = getattr(wo, "order", None)
    if order is None:
        return None
    if order.device.type != "cpu" or order.shape != (value_dim,):
        return False
    order = order.to(torch.int64).contiguous()
    if not torch.equal(order.sort().values, torch.arange(value_dim)):
        return False
    return order


def _gdn_args(norm, mixer, hidden: int) -> _GDNArgs | None:
    lins = (mixer.wqkv, mixer.wz, mixer.wb, mixer.wa, mixer.wo)
    of = (kernels.activations(), None if norm is None else norm.weight, mixer.conv_w, mixer.dt_bias, mixer.a,
          mixer.norm, *lins, *(getattr(lin, "weight", None) for lin in lins), getattr(mixer.wo, "order", None))
    got = getattr(mixer, "_c_decode", None)
    if got is not None and got.of[0] == of[0] and all(a is b for a, b in zip(got.of[1:], of[1:])):
        return got
    plans = [_linear_plan(lin) for lin in lins]
    if any(p is None for p in plans) or any(lin.bias is not None for lin in lins):
        return None
    if any(getattr(lin, "order", None) is not None for lin in lins[:4]):  # an InputPermutedLinear reorders x first
        return None
    order = _gdn_order(mixer.wo, mixer.value_dim)
    if order is False:
        return None
    rows = (mixer.conv_dim, mixer.value_dim, mixer.nv, mixer.nv, hidden)
    if tuple(p.rows for p in plans) != rows or any(p.cols != hidden for p in plans[:4]) or plans[4].cols != mixer.value_dim:
        return None
    vecs = ((mixer.dt_bias, mixer.nv), (mixer.a, mixer.nv), (mixer.norm, mixer.dv))
    if norm is not None:
        vecs += ((norm.weight, hidden),)
    if any(not (_vec(t) and t.numel() == n) for t, n in vecs) or mixer.conv_w.shape != (mixer.conv_dim, mixer.kernel):
        return None
    if mixer.conv_w.dtype is not torch.float32 or mixer.conv_w.device.type != "cpu":
        return None
    args = _GDNArgs(of, plans, mixer.conv_w.t().contiguous(), order)
    mixer._c_decode = args
    return args


def _gdn_decode(x: torch.Tensor, norm, mixer, cache, step) -> torch.Tensor | None:
    """strata_gdn_decode over x (B, T, hidden) on the cache (see try_gdn_block), or None."""
    if not _ok(x, any_size=True) or x.dim() != 3:
        return None
    b, t, hidden = x.shape
    if b * t > kernels.FAST_BATCH_MAX or (t > 1 and not cache.tracking):  # a prompt: the chunked form
        return None
    n_new = step.n_new
    if n_new.device.type != "cpu" or n_new.shape != (b,):
        return None
    fn = _build.entry("strata_gdn_decode", _GDN_ARGTYPES, _INT)
    if fn is None:
        return None
    args = _gdn_args(norm, mixer, hidden)
    if args is None:
        return None
    cache.ensure(b, mixer.kernel, mixer.conv_dim, mixer.nv, mixer.dk, mixer.dv, x.dtype, x.device)
    conv, state = cache.conv, cache.state
    if conv.shape != (b, mixer.kernel - 1, mixer.conv_dim) or state.shape != (b, mixer.nv, mixer.dk, mixer.dv) \
            or not (_vec(conv) and _vec(state)):
        return None
    window = steps = None
    if cache.tracking:  # what a rollback needs: the conv window, the state after each position
        if t * state.nbytes > cache.STEP_BYTES:  # the torch form replays instead
            return None
        window = torch.empty(b, mixer.kernel - 1 + t, mixer.conv_dim)
        steps = torch.empty(t, *state.shape)
    n_new = n_new.to(torch.int64).contiguous()
    out = torch.empty_like(x)
    po = args.plans[4]
    ptr = (lambda u: None if u is None else u.data_ptr())
    ok = fn(x.data_ptr(), b, t, n_new.data_ptr(), hidden, ptr(None if norm is None else norm.weight),
            norm.eps if norm is not None else 0.0, args.fns, args.ws, args.rows, mixer.nk, mixer.nv, mixer.dk, mixer.dv,
            conv.data_ptr(), ptr(window), args.taps.data_ptr(), mixer.kernel, mixer.dt_bias.data_ptr(), mixer.a.data_ptr(),
            state.data_ptr(), ptr(steps), mixer.norm.data_ptr(), mixer.eps, int(mixer.gate_act == "sigmoid"), po.fnptr,
            po.ptr, ptr(args.order), int(norm is not None), out.data_ptr(), _build.pool_threads(None))
    if not ok:
        return None
    if cache.tracking:
        cache.state = steps[-1]
        cache.keep_undo(state, window, n_new, list(steps.unbind(0)))
    else:
        cache.window = None
    return out


def try_gdn_block(x: torch.Tensor, norm, mixer, cache, step) -> torch.Tensor | None:
    """x + mixer(norm(x)) of a Gated DeltaNet layer (`models.gated_deltanet`) for decode tokens
    in one C call (deltanet_decode.c: norm, the in-projections, the causal conv step, the gated
    delta rule stepped row by row and position by position on the cache's state, the gated RMS
    norm, the out projection, the residual), or None where it does not apply (not float32 on the
    CPU; more than one position per row but in a speculative verify pass, the cache tracking;
    more than FAST_BATCH_MAX tokens; a tracked pass whose per-position states would pass the
    cache's STEP_BYTES; a weight without an own kernel). A verify pass keeps, as the torch form
    does, the conv window and the state after each position for `GDNCache.rollback`. The caller
    checks the module and cache types."""
    return _gdn_decode(x, norm, mixer, cache, step)


def try_gdn_mixer(x: torch.Tensor, mixer, cache, step) -> torch.Tensor | None:
    """mixer(x) of a Gated DeltaNet layer without input norm or residual (qwen4exp: its
    hyper-connections make the input and take the output), ssm_out's input order included (its
    `InputPermutedLinear`), in the same one C call as `try_gdn_block`, or None where it does not apply."""
    return _gdn_decode(x, None, mixer, cache, step)


def try_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over x's last dimension for a prompt-sized float32 x, in
    one C call on this thread (torch's five operators are five OpenMP regions, each a wait for a
    descheduled peer thread on a shared machine); None for a decode-sized x or where it does not
    apply, and the caller runs torch."""
    if (x.numel() <= DECODE_MAX or not kernels.USE_KERNELS or x.dtype is not torch.float32
            or weight.dtype is not torch.float32 or x.device.type != "cpu" or not x.is_contiguous()
            or weight.device.type != "cpu" or weight.numel() != x.shape[-1] or not weight.is_contiguous()):
        return None
    fn = _build.entry("strata_pp_rmsnorm", (_P, _I64, _I64, _P, _F32, _P))
    if fn is None:
        return None
    n = x.shape[-1]
    out = torch.empty_like(x)
    fn(x.data_ptr(), x.numel() // n, n, weight.data_ptr(), eps, out.data_ptr())
    return out


# A verify pass's new tokens per row: up to 16 drafted ones (--draft-tokens) and the last accepted
# one. A prompt of more attends by torch's SDPA, as prefill and the tiered KV caches do, so a short
# prompt's logits do not depend on which cache holds its keys.
ROWS_NEW_MAX = 17
_ROWS_ARGTYPES = (_P, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _INT)


def try_attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor) -> torch.Tensor | None:
    """Causal attention of a few new tokens per row over a KV cache in one C call
    (decode_attention.c's strata_attend_rows): q (B, H, T, D) (any strides, D contiguous);
    k_cache, v_cache (B, H_kv, capacity, D), this step's keys written; new token t of row b sees
    keys 0 .. start[b] + t, as `StepInfo.attention_mask` says. Returns (B, H, T, D) (a view of
    (B, T, H, D)), each row equal to its one-token step's attention; None where it does not apply
    (kernels off, not float32 contiguous caches on the CPU, more than FAST_BATCH_MAX new tokens or
    ROWS_NEW_MAX a row)."""
    b, h, t, d = q.shape
    if (not kernels.USE_KERNELS or b * t > kernels.FAST_BATCH_MAX or t > ROWS_NEW_MAX or q.dtype is not torch.float32
            or q.device.type != "cpu" or q.stride(3) != 1 or not (_vec(k_cache) and _vec(v_cache))
            or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d
            or h % k_cache.shape[1] or start.device.type != "cpu" or start.shape != (b,)):
        return None
    fn = _build.entry("strata_attend_rows", _ROWS_ARGTYPES, _INT)
    if fn is None:
        return None
    start = start.to(torch.int64).contiguous()
    most = int(start.max()) + t
    scores = torch.empty(b * h * t * most)
    out = torch.empty(b, t, h, d)
    if not fn(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k_cache.data_ptr(), v_cache.data_ptr(),
              k_cache.shape[2], start.data_ptr(), b, t, h, k_cache.shape[1], d, scores.data_ptr(), out.data_ptr(),
              _build.pool_threads(None)):
        return None
    return out.transpose(1, 2)
