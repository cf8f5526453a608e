"""A decode token through all of a model's llama-style layers in one C call (decode_stack.c).

The one-call-per-half path (decode_ops.try_attention_block / try_ffn_block / try_moe_block) left
~0.1 ms of Python per layer (module checks, argument packing, two ctypes trips) on the calling
thread, while the kernel pool's helper thread found no job, slept, and was woken by the next
product: on SmolLM2 at 2 threads the calling thread did 12.5 ms of each token and the helper 6.3.
Here the layer descriptions are built once (`Stack`), and a token is one call that runs the same
halves back to back, so the result equals the per-half path's and the helper stays busy.

Each `try_*` returns None where it does not apply, and the caller runs its per-block loop.
"""

from __future__ import annotations

import ctypes
import operator
import threading
import weakref
from functools import partial
from typing import NamedTuple

import torch

from strata import kernels
from strata.formats.weights import QTensor
from strata.kernels import _build, decode_ops
from strata.kernels.decode_ops import _ok, _swiglu_plans, _vec

_P, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class Layer(ctypes.Structure):
    """decode_stack.c's strata_layer, field for field (all 8 bytes wide: no padding to agree on)."""
    _fields_ = [
        ("attn_norm", _P), ("attn_eps", _F64), ("qkv_fn", _P * 3), ("qkv_w", _P * 3), ("qkv_rows", _I64 * 3),
        ("qkv_bias", _P * 3), ("n_heads", _I64), ("n_kv", _I64), ("head_dim", _I64), ("q_norm", _P),
        ("k_norm", _P), ("qk_eps", _F64), ("rot", _I64), ("interleaved", _I64), ("gated", _I64), ("kc", _P),
        ("vc", _P), ("cap", _I64), ("o_fn", _P), ("o_w", _P),
        ("ffn_norm", _P), ("ffn_eps", _F64), ("moe", _I64), ("ffn_fn", _P * 3), ("ffn_w", _P * 3),
        ("ffn_rows", _I64), ("sh_gate", _P), ("router", _P), ("n_exp", _I64), ("k", _I64), ("normalize", _I64),
        ("exp_w", _P * 3), ("exp_stride", _I64 * 3), ("exp_fn", _P * 3), ("exp_ffn", _I64),
        ("gdn", _I64), ("gdn_fn", _P * 4), ("gdn_w", _P * 4), ("gdn_rows", _I64 * 4), ("nk", _I64), ("nv", _I64),
        ("dk", _I64), ("dv", _I64), ("conv", _P), ("taps", _P), ("kernel", _I64), ("dt_bias", _P), ("ssm_a", _P),
        ("state", _P), ("ssm_norm", _P), ("ssm_eps", _F64), ("gate_sigmoid", _I64), ("order", _P),
    ]


def _attention(lay: Layer, norm, attn, hidden: int, keep: list, rot_half: int) -> bool:
    """Fill lay's attention half from the modules (what try_attention_block checks); False where it
    does not apply."""
    parts = decode_ops.attention_parts(norm, attn, hidden)
    if parts is None:
        return False
    plans, biases, qn, kn, rot = parts
    if rot // 2 != rot_half:
        return False
    po = plans[3]
    keep += plans
    lay.attn_norm, lay.attn_eps = norm.weight.data_ptr(), norm.eps
    lay.qkv_fn[:] = [p.fnptr for p in plans[:3]]
    lay.qkv_w[:] = [p.ptr for p in plans[:3]]
    lay.qkv_rows[:] = [p.rows for p in plans[:3]]
    lay.qkv_bias[:] = [None if b is None else b.data_ptr() for b in biases]
    lay.n_heads, lay.n_kv, lay.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
    lay.q_norm = qn.weight.data_ptr() if qn is not None else None
    lay.k_norm = kn.weight.data_ptr() if kn is not None else None
    lay.qk_eps = qn.eps if qn is not None else 0.0
    lay.rot, lay.interleaved, lay.gated = rot, int(attn.rope.cfg.interleaved), int(attn.gated)
    lay.o_fn, lay.o_w = po.fnptr, po.ptr
    return True


def _deltanet(lay: Layer, norm, mixer, hidden: int, keep: list) -> bool:
    """Fill lay's mixer half with a Gated DeltaNet (what try_gdn_block checks: the same
    decode_ops._gdn_args, so the same kernels); False where it does not apply."""
    args = decode_ops._gdn_args(norm, mixer, hidden)
    if args is None:
        return False
    keep.append(args)  # its plans, conv taps and order
    lay.gdn, lay.attn_norm, lay.attn_eps = 1, norm.weight.data_ptr(), norm.eps
    lay.gdn_fn[:], lay.gdn_w[:], lay.gdn_rows[:] = list(args.fns), list(args.ws), list(args.rows)
    lay.nk, lay.nv, lay.dk, lay.dv = mixer.nk, mixer.nv, mixer.dk, mixer.dv
    lay.taps, lay.kernel = args.taps.data_ptr(), mixer.kernel
    lay.dt_bias, lay.ssm_a, lay.ssm_norm = mixer.dt_bias.data_ptr(), mixer.a.data_ptr(), mixer.norm.data_ptr()
    lay.ssm_eps, lay.gate_sigmoid = mixer.eps, int(mixer.gate_act == "sigmoid")
    lay.order = None if args.order is None else args.order.data_ptr()
    po = args.plans[4]
    lay.o_fn, lay.o_w = po.fnptr, po.ptr
    return True


def _dense(lay: Layer, ffn, hidden: int, keep: list) -> bool:
    plans = _swiglu_plans(ffn, hidden)
    if plans is None:
        return False
    keep += plans
    lay.ffn_fn[:] = [p.fnptr for p in plans]
    lay.ffn_w[:] = [p.ptr for p in plans]
    lay.ffn_rows = plans[0].rows
    return True


def _moe(lay: Layer, moe, k: int, normalize: bool, hidden: int, keep: list) -> bool:
    """Fill lay's MoE half (what try_moe_block checks): the router, the stacked resident experts, a
    `SharedExpert` (the caller checks the types and the router's rule)."""
    router = moe.router
    if not _vec(router) or router.dim() != 2 or router.shape[1] != hidden:
        return False
    b = moe.experts.backend
    stacked = (b.gate, b.up, b.down)
    plans = kernels.stacked_plans(stacked, hidden)
    n_exp = router.shape[0]
    if plans is None or stacked[0].shape[0] != n_exp or not 0 < k <= min(n_exp, 128):
        return False
    if moe.shared is not None:
        if not _dense(lay, moe.shared.ffn, hidden, keep):
            return False
        gate = moe.shared.gate
        if gate is not None:
            if not _vec(gate) or gate.numel() != hidden:
                return False
            lay.sh_gate = gate.data_ptr()
    keep += [pl for pl, _ in plans]
    lay.moe, lay.router, lay.n_exp, lay.k, lay.normalize = 1, router.data_ptr(), n_exp, k, int(normalize)
    lay.exp_w[:] = [pl.ptr for pl, _ in plans]
    lay.exp_stride[:] = [s for _, s in plans]
    lay.exp_fn[:] = [pl.fnptr for pl, _ in plans]
    lay.exp_ffn = plans[0][0].rows
    return True


def _weight(norm):
    return norm._parameters["weight"] if norm is not None else None


def _tensor(m, name: str):
    """m.name of a tensor attribute, parameter or buffer, without nn.Module's attribute lookup."""
    d = m.__dict__
    if name in d:
        return d[name]
    got = m._parameters.get(name)
    return got if got is not None else m._buffers[name]


_GDN_TENSORS = ("conv_w", "dt_bias", "a", "norm")


def sources(blocks) -> list | None:
    """What a Stack of these blocks is built from, compared by identity on each step (through the
    modules' own dicts: nn.Module's attribute lookup cost ~1 us a name, which over a 30-layer model
    was a millisecond per token): the blocks' norms, attentions and FFNs, their weight tensors and
    Linears, and the activation mode. A replaced module or weight, or another mode, means a new Stack.
    None: a block is not of the kind a Stack takes."""
    try:
        return _sources(blocks)
    except (KeyError, AttributeError):
        return None


def _sources(blocks) -> list:
    out = [kernels.activations()]
    for b in blocks:
        m = b._modules
        an, at, fn_, ff = m["attn_norm"], m["attn"], m["ffn_norm"], m["ffn"]
        ad, am, fd = at.__dict__, at._modules, ff.__dict__
        out += (b, an, at, fn_, ff, _weight(an), _weight(fn_))
        if "wqkv" in ad:  # a Gated DeltaNet (the caller checks the types)
            lins = [ad["wqkv"], ad["wz"], ad["wb"], ad["wa"], ad["wo"]]
            out += [_tensor(at, n) for n in _GDN_TENSORS]
            out.append(getattr(lins[-1], "order", None))
        else:
            q_norm, k_norm = am.get("q_norm"), am.get("k_norm")
            out += (q_norm, k_norm, _weight(q_norm), _weight(k_norm))
            lins = [ad["wq"], ad["wk"], ad["wv"], ad["wo"]]
        if "router" in fd:  # a MoE (the caller checks the types)
            ex, shared = ff._modules["experts"], ff._modules.get("shared")
            be = ex.__dict__["backend"]
            out += (fd["router"], fd["route"], ex, be, be.gate, be.up, be.down, shared)
            if shared is not None:
                sd = shared._modules["ffn"].__dict__
                lins += [sd["gate"], sd["up"], sd["down"]]
                out.append(shared.__dict__["gate"])
        else:
            lins += [fd["gate"], fd["up"], fd["down"]]
        out += lins
        for lin in lins:
            out += (lin.weight, lin.bias)
    return out


class Stack:
    """The C descriptions of a model's layers, built once (`layers` None: some layer does not
    apply, so the model runs its blocks one by one); the KV cache pointers are refreshed per call."""

    __slots__ = ("sources", "layers", "keep", "hidden", "rot_half", "caches", "tmp", "lock", "gdn")

    def __init__(self, sources, layers: ctypes.Array | None, keep: list, hidden: int, rot_half: int):
        self.sources, self.layers, self.keep, self.hidden, self.rot_half = sources, layers, keep, hidden, rot_half
        # per layer, a Gated DeltaNet one's cache shapes (`_gdn_dims`), else None (read once: a ctypes
        # field read per layer per token is Python on caches the kernels have just flushed)
        self.gdn = tuple(_gdn_dims(lay) if lay.gdn else None for lay in layers) if layers is not None else ()
        self.caches: list = [None] * (len(layers) if layers is not None else 0)  # weak references to the
        # (k, v) each layer's pointers name
        self.tmp = torch.empty(hidden)
        self.lock = threading.Lock()  # the layers' KV pointers and tmp serve one call at a time


class _GDNDims(NamedTuple):
    """A DeltaNet layer's recurrent cache shapes, read from its Layer once."""

    kernel: int
    conv_dim: int
    nv: int
    dk: int
    dv: int


def _gdn_dims(lay: Layer) -> _GDNDims:
    return _GDNDims(lay.kernel, 2 * lay.nk * lay.dk + lay.nv * lay.dv, lay.nv, lay.dk, lay.dv)


def build(key: list | None, layers, hidden: int, rot_half: int) -> Stack:
    """The Stack of `layers`, each (attn_norm, mixer, ffn_norm, ffn, route): the mixer an attention
    or a Gated DeltaNet (one with `wqkv`; the caller checks the types); route None for a dense
    SwiGLU `ffn`, else the MoE router's (k, normalize); `key`: their `sources`."""
    sources = key
    if key is None:
        return Stack(None, None, [], hidden, rot_half)
    arr = (Layer * len(layers))()
    keep: list = []
    for lay, (attn_norm, attn, ffn_norm, ffn, route) in zip(arr, layers):
        mixer = _deltanet if "wqkv" in attn.__dict__ else partial(_attention, rot_half=rot_half)
        ok = mixer(lay, attn_norm, attn, hidden, keep=keep) and _vec(ffn_norm.weight) \
            and ffn_norm.weight.numel() == hidden
        if ok:
            lay.ffn_norm, lay.ffn_eps = ffn_norm.weight.data_ptr(), ffn_norm.eps
            ok = _dense(lay, ffn, hidden, keep) if route is None else _moe(lay, ffn, *route, hidden, keep)
        if not ok:
            return Stack(sources, None, [], hidden, rot_half)
    return Stack(sources, arr, keep, hidden, rot_half)


def current(stack: Stack | None, key: list | None, hidden: int, rot_half: int) -> bool:
    """Whether `stack` was built from these `sources` (`key`), hidden size and rotary width."""
    if stack is None or key is None or stack.hidden != hidden or stack.rot_half != rot_half:
        return False
    return len(key) == len(stack.sources) and all(map(operator.is_, key, stack.sources))


_ARGTYPES = (_P, _I64, _I64, _P, _P, _P, _I64, _P, ctypes.c_int)
_TOKEN_ARGTYPES = _ARGTYPES + (ctypes.c_int, _P, _I64, _P, ctypes.c_float, _P, _P, _I64, _P)
_HEAD_ARGTYPES = (_P, _I64, _P, ctypes.c_float, _P, _P, _I64, _P, _P, ctypes.c_int)


class Ends(NamedTuple):
    """A decode token's two ends in C (decode_stack.c's strata_decode_token / strata_decode_head):
    the embedding row by ggml's to_float as `Embedding` decodes it (embd_ptr 0: a table of another
    kind, looked up in Python), and the final RMS norm with the output head's strata_qmm_* kernel."""

    embd_type: int
    embd_ptr: int
    embd_bytes: int  # one row's
    vocab_rows: int  # the embedding's rows (token ids below it)
    norm: int
    eps: float
    head_fn: int
    head_w: int
    vocab: int
    hidden: int
    keep: tuple  # the tensors the pointers name


def ends(norm_w: torch.Tensor, eps: float, head: QTensor, embd: QTensor | None, hidden: int) -> Ends | None:
    """The Ends of a model's final norm (its weight, eps), output head (a quantized weight, no bias)
    and embedding table (a quantized one C can decode, else None: looked up in Python); None where
    the head does not apply (a type without a strata_qmm_* kernel): the model runs it in torch
    (the caller checks the modules' kinds)."""
    if not _vec(norm_w) or norm_w.numel() != hidden:
        return None
    plan = kernels._plan(head)
    if plan is None or plan.fnptr is None or plan.cols != hidden:
        return None
    keep: list = [norm_w, plan]
    embd_type = embd_ptr = embd_bytes = rows = 0
    if (embd is not None and embd.raw.device.type == "cpu" and len(embd.shape) == 2 and embd.shape[1] == hidden
            and kernels._type_name(embd.qtype) in _build.GGML_TYPES):
        raw = _build.raw_bytes(embd)
        per_row = raw.numel() // embd.shape[0]
        if raw.is_contiguous() and per_row * embd.shape[0] == raw.numel():
            embd_type, embd_ptr, embd_bytes, rows = int(embd.qtype), raw.data_ptr(), per_row, embd.shape[0]
            keep.append(raw)
    return Ends(embd_type, embd_ptr, embd_bytes, rows, norm_w.data_ptr(), float(eps), plan.fnptr, plan.ptr,
                plan.rows, hidden, tuple(keep))


def try_head(e: Ends, x: torch.Tensor) -> torch.Tensor | None:
    """The logits (1, 1, vocab) of one decode token's last hidden state x (1, 1, hidden) by
    strata_decode_head, or None where it does not apply (then the model's torch modules run)."""
    if not _ok(x) or x.numel() != e.hidden:
        return None
    fn = _build.entry("strata_decode_head", _HEAD_ARGTYPES, None)
    if fn is None:
        return None
    x = x.contiguous()
    xn = torch.empty(e.hidden)
    logits = torch.empty(1, 1, e.vocab)
    fn(x.data_ptr(), e.hidden, e.norm, e.eps, e.head_fn, e.head_w, e.vocab, xn.data_ptr(), logits.data_ptr(),
       _build.pool_threads(None))
    return logits


class Partial(NamedTuple):
    """A stack stopped by a layer half that found no memory for its scratch: the caller runs the
    rest with the blocks (the per-half path's fallback to torch), from layer `layer`'s input `x`,
    or, `h` set, from that layer's FFN half (its mixer ran: a DeltaNet state is not stepped twice)."""

    x: torch.Tensor
    layer: int
    h: torch.Tensor | None


def try_decode(stack: Stack, x: torch.Tensor | None, caches, pos: int, rope_cs, token: tuple | None = None):
    """x (1, 1, hidden) after every layer of `stack` for the token at `pos`, the keys and values
    written into `caches` (a KVCache per attention layer, a GDNCache per DeltaNet one), a `Partial`
    where a half found no memory, or None where it does not apply (not one float32 token on the
    CPU, a cache of another dtype or layout or tracking, kernels off). With `token` (an `Ends`
    with a C-decodable embedding, the token id), x is unused and rope_cs are (rows, rot / 2)
    tables of which row pos is this token's: the token goes from its embedding row through the
    layers and the head in one C call, and its logits (1, 1, vocab) come back (or a Partial, its
    x the input of the layer that failed)."""
    if stack.layers is None:
        return None
    if token is None:
        if not _ok(x) or x.numel() != stack.hidden:
            return None
        fn = _build.entry("strata_decode_stack", _ARGTYPES, ctypes.c_int64)
    else:
        e, tid = token
        if not e.embd_ptr or e.hidden != stack.hidden or not 0 <= tid < e.vocab_rows:
            return None
        fn = _build.entry("strata_decode_token", _TOKEN_ARGTYPES, ctypes.c_int64)
    cos, sin = rope_cs
    if fn is None or not (_vec(cos) and _vec(sin)):
        return None
    if token is None:
        if cos.numel() != stack.rot_half or sin.numel() != stack.rot_half:
            return None
        rot = cos.data_ptr(), sin.data_ptr()
    else:  # rope_cs: (rows, rot / 2) tables, row pos this token's
        if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != stack.rot_half or not 0 <= pos < cos.shape[0]:
            return None
        rot = cos.data_ptr() + 4 * pos * stack.rot_half, sin.data_ptr() + 4 * pos * stack.rot_half
    if not stack.lock.acquire(blocking=False):  # another thread is decoding with this model: its own path
        return None
    try:
        if token is None:
            return _run(fn, stack, x.contiguous().clone(), caches, pos, rot)
        logits = torch.empty(1, 1, e.vocab)
        return _run(fn, stack, torch.empty(1, 1, stack.hidden), caches, pos, rot,
                    (e.embd_type, e.embd_ptr + tid * e.embd_bytes, e.embd_bytes, e.norm, e.eps, e.head_fn, e.head_w,
                     e.vocab, logits.data_ptr()), logits)
    finally:
        stack.lock.release()


def _run(fn, stack: Stack, out: torch.Tensor, caches, pos: int, rot: tuple[int, int], ends: tuple = (),
         logits: torch.Tensor | None = None):
    """try_decode under the stack's lock: each layer's cache checked (nothing is stepped before all
    apply: a DeltaNet state stepped twice would be wrong), grown to hold pos, its pointers
    refreshed where its tensors changed, then the one C call (out: the token's x, the layers' input
    and output; `ends`: strata_decode_token's further arguments, its logits into `logits`)."""
    layers = stack.layers
    for i, (gdn, cache) in enumerate(zip(stack.gdn, caches)):
        if gdn is not None:
            if not _deltanet_cache(stack, i, layers[i], gdn, cache, out):
                return None
        elif not _kv_cache(stack, i, layers[i], cache, out, pos):
            return None
    n = len(stack.layers)
    done = fn(ctypes.addressof(stack.layers), n, stack.hidden, out.data_ptr(), rot[0], rot[1], pos,
              stack.tmp.data_ptr(), _build.pool_threads(None), *ends)
    if done < 0:
        return None
    for gdn, cache in zip(stack.gdn[:(done + 1) // 2], caches):
        if gdn is not None:
            cache.window = None  # as try_gdn_block leaves an untracked cache
    if done == 2 * n:
        return out if logits is None else logits
    h = stack.tmp.clone().view_as(out) if done % 2 else None
    return Partial(out, done // 2, h)


def _kv_cache(stack: Stack, i: int, lay: Layer, cache, x: torch.Tensor, pos: int) -> bool:
    """Layer i's KV cache (a KVCache) checked, grown to hold pos, its pointers refreshed. A cache
    whose tensors are the ones the layer names and hold pos is one lookup (the rest was checked
    when the layer took them: a KVCache grows into new tensors)."""
    d = cache.__dict__
    kc = d.get("k", False)
    known = stack.caches[i]
    if known is not None and pos < known[2] and kc is not None and known[0]() is kc and known[1]() is d["v"]:
        return True  # (a dead reference reads None: hence kc is not None)
    if kc is False:  # not a KVCache
        return False
    if kc is not None and (kc.dtype is not torch.float32 or kc.device.type != "cpu"):  # before it grows
        return False
    if kc is None or pos + 1 > kc.shape[2]:  # the cache grows (else _reserve has nothing to do)
        like = x.new_empty(1, 1, 1, lay.head_dim)  # what _reserve reads: dtype, device and head_dim
        cache._reserve(1, lay.n_kv, pos + 1, like, like)
        kc = cache.k
    if known is None or known[0]() is not kc or known[1]() is not cache.v:
        vc = cache.v
        if (kc.dtype is not torch.float32 or kc.device.type != "cpu" or kc.shape != (1, lay.n_kv, kc.shape[2], lay.head_dim)
                or vc.shape != kc.shape or vc.dtype is not torch.float32 or not (kc.is_contiguous() and vc.is_contiguous())):
            return False
        lay.kc, lay.vc, lay.cap = kc.data_ptr(), vc.data_ptr(), kc.shape[2]
        # not kept alive past their request; and the capacity, which the tensors keep
        stack.caches[i] = (weakref.ref(kc), weakref.ref(vc), kc.shape[2])
    return True


def _deltanet_cache(stack: Stack, i: int, lay: Layer, dims: _GDNDims, cache, x: torch.Tensor) -> bool:
    """Layer i's recurrent cache (a GDNCache, not tracking: a speculative pass keeps per-position
    states, which the block path does) made on its first token, checked, its conv / state pointers
    refreshed where its tensors changed (`dims`: the layer's shapes, read once)."""
    d = cache.__dict__
    if "state" not in d or d["tracking"]:
        return False
    conv, state = d["conv"], d["state"]
    known = stack.caches[i]
    if conv is not None and known is not None and known[0]() is conv and known[1]() is state:
        return True  # (a dead reference reads None: hence the first test)
    if conv is None:
        cache.ensure(1, dims.kernel, dims.conv_dim, dims.nv, dims.dk, dims.dv, x.dtype, x.device)
        conv, state = cache.conv, cache.state
    if conv.shape != (1, dims.kernel - 1, dims.conv_dim) or state.shape != (1, dims.nv, dims.dk, dims.dv) \
            or not (_vec(conv) and _vec(state)):
        return False
    lay.conv, lay.state = conv.data_ptr(), state.data_ptr()
    stack.caches[i] = (weakref.ref(conv), weakref.ref(state))
    return True
