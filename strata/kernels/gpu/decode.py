"""Triton decoders: ggml values straight from their blocks' bytes, as (rows, groups, 32) tiles.

Each `_<type>(blk, s, l, ..., W)` returns, as float32, value l (0-31, the tile's last axis) of the
32-value group s (the middle axis) of the block at blk, by the same formulas as `strata.quant`
(bit-exact against gguf-py). For the 256-value k- and i-quants blk is one pointer per row,
shape (rows, 1, 1), and s numbers the super-block's eight groups; for the 32-value types every
group is a block of its own: blk is (rows, groups, 1) and s is unused.

Loads are vectorised: a group's per-value bytes (its 32 or 16 quant bytes, grid indices, high
bits) are read as a run of W-byte words (`_run`: 4 where the block layout keeps them 4-byte
aligned, 2 where only 2, 1 for MXFP4's 17-byte blocks) and unpacked in registers, so the compiler
issues 16-byte vector loads where the alignment allows; fields a group shares (its scale, sign
word) are loaded once per group and spread over its values (`_spread`). `decode` picks the
decoder from the ggml type id, a compile-time constant, so each kernel is specialised to one type.
Lookup tables (i-quant grids, sign patterns, IQ4 and E2M1 values) come in as float32 tensors
from `strata.quant`, so they are gguf-py's own.
"""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

# the type ids as compile-time constants, for `decode`'s static dispatch
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (tl.constexpr(int(t)) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (tl.constexpr(int(t)) for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K))
IQ4_NL, IQ4_XS, MXFP4 = (tl.constexpr(int(t)) for t in (T.IQ4_NL, T.IQ4_XS, T.MXFP4))
IQ2_XXS, IQ2_XS, IQ3_XXS = (tl.constexpr(int(t)) for t in (T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS))

# the widest word each type's per-value fields stay aligned to, given blocks laid end to end from
# an aligned row: a block's size and its fields' offsets (Q4_K: 144-byte blocks, quants at 16)
WORD = {T.Q4_0: 2, T.Q4_1: 4, T.Q5_0: 2, T.Q5_1: 4, T.Q8_0: 2, T.Q2_K: 4, T.Q3_K: 2, T.Q4_K: 4,
        T.Q5_K: 4, T.Q6_K: 2, T.IQ4_NL: 2, T.IQ4_XS: 4, T.MXFP4: 1, T.IQ2_XXS: 2, T.IQ2_XS: 2, T.IQ3_XXS: 2}


@triton.jit
def _byte(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _signed(b):
    """A byte read as int8."""
    return b - ((b >> 7) << 8)


@triton.jit
def _u16(p, W: tl.constexpr):
    """The little-endian u16 at p (2-byte aligned when W >= 2), as int32."""
    if W >= 2:
        v = tl.load(p.to(tl.pointer_type(tl.uint16))).to(tl.int32)
    else:
        v = _byte(p) | (_byte(p + 1) << 8)
    return v


@triton.jit
def _f16(p, W: tl.constexpr):
    return _u16(p, W).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u32(p, W: tl.constexpr):
    """The little-endian u32 at p, as uint32, read as two u16 words (W >= 2)."""
    return _u16(p, W).to(tl.uint32) | (_u16(p + 2, W).to(tl.uint32) << 16)


@triton.jit
def _run(p, N: tl.constexpr, W: tl.constexpr):
    """int32 (rows, groups, N): bytes p[0..N) for each pointer of p (rows, groups, 1), read as N // W
    words of W bytes and unpacked in registers."""
    if W == 1:
        b = tl.load(p + tl.arange(0, N)[None, None, :]).to(tl.int32)
    else:
        if W == 4:
            words = tl.load(p.to(tl.pointer_type(tl.uint32)) + tl.arange(0, N // 4)[None, None, :])
        else:
            words = tl.load(p.to(tl.pointer_type(tl.uint16)) + tl.arange(0, N // 2)[None, None, :]).to(tl.uint32)
        shift = (tl.arange(0, W) * 8).to(tl.uint32)[None, None, None, :]
        b = tl.reshape(((words[:, :, :, None] >> shift) & 0xFF).to(tl.int32),
                       (words.shape[0], words.shape[1], N))
    return b


@triton.jit
def _spread(t, R: tl.constexpr):
    """(rows, groups, n) -> (rows, groups, n * R): each value repeated R times (value j covers j*R..)."""
    return tl.reshape(tl.broadcast_to(t[:, :, :, None], (t.shape[0], t.shape[1], t.shape[2], R)),
                      (t.shape[0], t.shape[1], t.shape[2] * R))


@triton.jit
def _nibbles(p, W: tl.constexpr):
    """int32 (rows, groups, 32) from 16 bytes: value l is the low nibble of byte l for l < 16, the
    high nibble of byte l - 16 after (ggml's 32-value layout)."""
    b = _run(p, 16, W)
    both = tl.permute(tl.join(b & 0xF, b >> 4), (0, 1, 3, 2))  # (rows, groups, 2, 16)
    return tl.reshape(both, (b.shape[0], b.shape[1], 32))


@triton.jit
def _halves(s, off, STRIDE: tl.constexpr):
    """(1, groups, 2) offsets off + STRIDE * (2 s + h) of a field per 16 values (h the half)."""
    return off + (2 * s + tl.arange(0, 2)[None, None, :]) * STRIDE


@triton.jit
def _q8_0(blk, s, l, W: tl.constexpr):
    return _f16(blk, W) * _signed(_run(blk + 2, 32, W)).to(tl.float32)


@triton.jit
def _q4_0(blk, s, l, W: tl.constexpr):
    return _f16(blk, W) * (_nibbles(blk + 2, W) - 8).to(tl.float32)


@triton.jit
def _q4_1(blk, s, l, W: tl.constexpr):
    return _f16(blk, W) * _nibbles(blk + 4, W).to(tl.float32) + _f16(blk + 2, W)


@triton.jit
def _q5_0(blk, s, l, W: tl.constexpr):
    high = ((_u32(blk + 2, W) >> l.to(tl.uint32)) & 1).to(tl.int32)  # bit l of the block's u32
    return _f16(blk, W) * ((_nibbles(blk + 6, W) | (high << 4)) - 16).to(tl.float32)


@triton.jit
def _q5_1(blk, s, l, W: tl.constexpr):
    high = ((_u32(blk + 4, W) >> l.to(tl.uint32)) & 1).to(tl.int32)
    return _f16(blk, W) * (_nibbles(blk + 8, W) | (high << 4)).to(tl.float32) + _f16(blk + 2, W)


@triton.jit
def _q2_k(blk, s, l, W: tl.constexpr):
    sc = _spread(_byte(blk + _halves(s, 0, 1)), 16)  # a scale byte per 16 values: low nibble scale, high min
    q = (_run(blk + 16 + (s // 4) * 32, 32, W) >> ((s % 4) * 2)) & 3  # 2 halves x 4 bit planes x 32 bytes
    dl = _f16(blk + 80, W) * (sc & 0xF).to(tl.float32)
    ml = _f16(blk + 82, W) * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k(blk, s, l, W: tl.constexpr):
    s16 = 2 * s + tl.arange(0, 2)[None, None, :]  # sixteen 6-bit scales: low nibbles at 96-103, top 2 bits at 104-107
    low = (_byte(blk + 96 + s16 % 8) >> ((s16 // 8) * 4)) & 0xF
    high = (_byte(blk + 104 + s16 % 4) >> ((s16 // 4) * 2)) & 3
    sc = _spread((low | (high << 4)) - 32, 16)
    ql = (_run(blk + 32 + (s // 4) * 32, 32, W) >> ((s % 4) * 2)) & 3
    hm = (_run(blk, 32, W) >> s) & 1  # a set mask bit means "no -4 offset"
    q = ql - ((hm ^ 1) << 2)
    return _f16(blk + 108, W) * sc.to(tl.float32) * q.to(tl.float32)


@triton.jit
def _scale_min_k4(p, s):
    """Q4_K/Q5_K: the 6-bit scale and min of sub-block s from the 12 packed bytes at p."""
    a = _byte(p + s)
    b = _byte(p + s + 4)
    c = _byte(p + tl.maximum(s - 4, 0))
    sc = tl.where(s < 4, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(s < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc, mn


@triton.jit
def _q4_k(blk, s, l, W: tl.constexpr):
    sc, mn = _scale_min_k4(blk + 4, s)
    dl = _f16(blk, W) * sc.to(tl.float32)
    ml = _f16(blk + 2, W) * mn.to(tl.float32)
    q = (_run(blk + 16 + (s // 2) * 32, 32, W) >> ((s % 2) * 4)) & 0xF
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q5_k(blk, s, l, W: tl.constexpr):
    sc, mn = _scale_min_k4(blk + 4, s)
    dl = _f16(blk, W) * sc.to(tl.float32)
    ml = _f16(blk + 2, W) * mn.to(tl.float32)
    q = ((_run(blk + 48 + (s // 2) * 32, 32, W) >> ((s % 2) * 4)) & 0xF) | (((_run(blk + 16, 32, W) >> s) & 1) << 4)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q6_k(blk, s, l, W: tl.constexpr):
    half = s // 4  # 128-value halves; low nibbles: 2 x 64 bytes, high 2 bits: 4 planes of 32 bytes
    ql = (_run(blk + half * 64 + (s % 2) * 32, 32, W) >> (((s // 2) % 2) * 4)) & 0xF
    qh = (_run(blk + 128 + half * 32, 32, W) >> ((s % 4) * 2)) & 3
    q = (ql | (qh << 4)) - 32
    sc = _spread(_signed(_byte(blk + _halves(s, 192, 1))), 16)
    return _f16(blk + 208, W) * sc.to(tl.float32) * q.to(tl.float32)


@triton.jit
def _iq4_nl(blk, s, l, vals, W: tl.constexpr):
    return _f16(blk, W) * tl.load(vals + _nibbles(blk + 2, W))


@triton.jit
def _iq4_xs(blk, s, l, vals, W: tl.constexpr):
    high = (_u16(blk + 2, W) >> (s * 2)) & 3
    sc = (((_byte(blk + 4 + s // 2) >> ((s % 2) * 4)) & 0xF) | (high << 4)) - 32
    return (_f16(blk, W) * sc.to(tl.float32)) * tl.load(vals + _nibbles(blk + 8 + s * 16, W))


@triton.jit
def _mxfp4(blk, s, l, vals, W: tl.constexpr):
    e = _byte(blk)
    half_scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return half_scale * tl.load(vals + _nibbles(blk + 1, W))


@triton.jit
def _sign(signs, index, bit):
    """+-1: bit `bit` of 7-bit sign pattern `index` (float32 [128, 8] table)."""
    return tl.load(signs + index * 8 + bit)


@triton.jit
def _iq2_xxs(blk, s, l, grid, signs, W: tl.constexpr):
    sub = blk + 2 + s * 8  # 4 grid bytes, then a u32: 4-bit scale over four 7-bit sign indices
    aux = _u32(sub + 4, W)
    db = _f16(blk, W) * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
    g = tl.arange(0, 4)[None, None, :]
    sidx = _spread(((aux >> (g * 7).to(tl.uint32)) & 0x7F).to(tl.int32), 8)
    gidx = _spread(_run(sub, 4, W), 8)
    return db * tl.load(grid + gidx * 8 + l % 8) * _sign(signs, sidx, l % 8)


@triton.jit
def _iq2_xs(blk, s, l, grid, signs, W: tl.constexpr):
    words = _run(blk + 2 + s * 8, 8, W)  # four u16: 9-bit grid index | 7-bit sign index << 9
    q = _spread(_pairs(words), 8)
    nib = (_byte(blk + 66 + s) >> (tl.arange(0, 2)[None, None, :] * 4)) & 0xF
    db = _f16(blk, W) * (0.5 + _spread(nib, 16).to(tl.float32)) * 0.25
    return db * tl.load(grid + (q & 511) * 8 + l % 8) * _sign(signs, q >> 9, l % 8)


@triton.jit
def _pairs(b):
    """(rows, groups, 2n) bytes -> (rows, groups, n) little-endian u16s of consecutive pairs."""
    lo, hi = tl.split(tl.reshape(b, (b.shape[0], b.shape[1], b.shape[2] // 2, 2)))
    return lo | (hi << 8)


@triton.jit
def _iq3_xxs(blk, s, l, grid, signs, W: tl.constexpr):
    aux = _u32(blk + 66 + s * 4, W)
    db = _f16(blk, W) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    g = tl.arange(0, 4)[None, None, :]
    sidx = _spread(((aux >> (g * 7).to(tl.uint32)) & 0x7F).to(tl.int32), 8)
    gidx = _spread(_run(blk + 2 + s * 8, 8, W), 4)
    return db * tl.load(grid + gidx * 4 + l % 4) * _sign(signs, sidx, l % 8)


@triton.jit
def decode(blk, s, l, grid, signs, vals, QTYPE: tl.constexpr, W: tl.constexpr):
    """float32 values of ggml type QTYPE: value l of 32-value group s of the block at blk, per-value
    bytes read in W-byte words (at most `WORD[QTYPE]`, and what the row pointers allow).

    For the 32-value types s is unused (each group is a block of its own, and blk says which).
    """
    if QTYPE == Q8_0:
        w = _q8_0(blk, s, l, W)
    elif QTYPE == Q4_0:
        w = _q4_0(blk, s, l, W)
    elif QTYPE == Q4_1:
        w = _q4_1(blk, s, l, W)
    elif QTYPE == Q5_0:
        w = _q5_0(blk, s, l, W)
    elif QTYPE == Q5_1:
        w = _q5_1(blk, s, l, W)
    elif QTYPE == Q2_K:
        w = _q2_k(blk, s, l, W)
    elif QTYPE == Q3_K:
        w = _q3_k(blk, s, l, W)
    elif QTYPE == Q4_K:
        w = _q4_k(blk, s, l, W)
    elif QTYPE == Q5_K:
        w = _q5_k(blk, s, l, W)
    elif QTYPE == Q6_K:
        w = _q6_k(blk, s, l, W)
    elif QTYPE == IQ4_NL:
        w = _iq4_nl(blk, s, l, vals, W)
    elif QTYPE == IQ4_XS:
        w = _iq4_xs(blk, s, l, vals, W)
    elif QTYPE == MXFP4:
        w = _mxfp4(blk, s, l, vals, W)
    elif QTYPE == IQ2_XXS:
        w = _iq2_xxs(blk, s, l, grid, signs, W)
    elif QTYPE == IQ2_XS:
        w = _iq2_xs(blk, s, l, grid, signs, W)
    else:
        tl.static_assert(QTYPE == IQ3_XXS, "no Triton decoder for this ggml type")
        w = _iq3_xxs(blk, s, l, grid, signs, W)
    return w
