"""Triton decoders: ggml values straight from their blocks' bytes, as (rows, groups, 32) tiles.

Each `_<type>(blk, s, l, ...)` returns, as float32, value l (0-31, the tile's last axis) of the
32-value group s (the middle axis) of the block at blk, by the same formulas as `strata.quant`
(bit-exact against gguf-py). For the 256-value k- and i-quants blk is one pointer per row,
shape (rows, 1, 1), and s numbers the super-block's eight groups, so fields a group shares
(sub-scales, sign words) depend on (blk, s) alone: they are loaded once per group and
broadcast over its 32 values. For the 32-value types every group is a block of its own: blk
is (rows, groups, 1) and s is unused. `decode` picks the decoder from the ggml type id, a
compile-time constant, so each kernel is specialised to one type.
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


@triton.jit
def _byte(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _signed(b):
    """A byte read as int8."""
    return b - ((b >> 7) << 8)


@triton.jit
def _f16(p):
    bits = _byte(p) | (_byte(p + 1) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u32(p):
    lo = _byte(p) | (_byte(p + 1) << 8) | (_byte(p + 2) << 16)
    return lo.to(tl.uint32) | (_byte(p + 3).to(tl.uint32) << 24)


@triton.jit
def _nibble(p, high):
    """Low nibble of the byte at p where high is 0, high nibble where it is 1."""
    return (_byte(p) >> (high * 4)) & 0xF


@triton.jit
def _q8_0(blk, s, l):
    return _f16(blk) * _signed(_byte(blk + 2 + l)).to(tl.float32)


@triton.jit
def _q4_0(blk, s, l):
    q = _nibble(blk + 2 + l % 16, l // 16) - 8
    return _f16(blk) * q.to(tl.float32)


@triton.jit
def _q4_1(blk, s, l):
    q = _nibble(blk + 4 + l % 16, l // 16)
    return _f16(blk) * q.to(tl.float32) + _f16(blk + 2)


@triton.jit
def _fifth_bit(p, j):
    """Bit j of the little-endian u32 at p (Q5_0/Q5_1)."""
    return (_byte(p + j // 8) >> (j % 8)) & 1


@triton.jit
def _q5_0(blk, s, l):
    q = (_nibble(blk + 6 + l % 16, l // 16) | (_fifth_bit(blk + 2, l) << 4)) - 16
    return _f16(blk) * q.to(tl.float32)


@triton.jit
def _q5_1(blk, s, l):
    q = _nibble(blk + 8 + l % 16, l // 16) | (_fifth_bit(blk + 4, l) << 4)
    return _f16(blk) * q.to(tl.float32) + _f16(blk + 2)


@triton.jit
def _q2_k(blk, s, l):
    sc = _byte(blk + 2 * s + l // 16)  # one scale byte per 16 values: low nibble scale, high nibble min
    q = (_byte(blk + 16 + (s // 4) * 32 + l) >> ((s % 4) * 2)) & 3  # 2 halves x 4 bit planes x 32 bytes
    dl = _f16(blk + 80) * (sc & 0xF).to(tl.float32)
    ml = _f16(blk + 82) * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k(blk, s, l):
    s16 = 2 * s + l // 16  # sixteen 6-bit scales: low nibbles in bytes 96-103, top 2 bits in 104-107
    low = _nibble(blk + 96 + s16 % 8, s16 // 8)
    high = (_byte(blk + 104 + s16 % 4) >> ((s16 // 4) * 2)) & 3
    sc = (low | (high << 4)) - 32
    ql = (_byte(blk + 32 + (s // 4) * 32 + l) >> ((s % 4) * 2)) & 3
    hm = (_byte(blk + l) >> s) & 1  # a set mask bit means "no -4 offset"
    q = ql - ((hm ^ 1) << 2)
    return _f16(blk + 108) * sc.to(tl.float32) * q.to(tl.float32)


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
def _q4_k(blk, s, l):
    sc, mn = _scale_min_k4(blk + 4, s)
    dl = _f16(blk) * sc.to(tl.float32)
    ml = _f16(blk + 2) * mn.to(tl.float32)
    return dl * _nibble(blk + 16 + (s // 2) * 32 + l, s % 2).to(tl.float32) - ml


@triton.jit
def _q5_k(blk, s, l):
    sc, mn = _scale_min_k4(blk + 4, s)
    dl = _f16(blk) * sc.to(tl.float32)
    ml = _f16(blk + 2) * mn.to(tl.float32)
    q = _nibble(blk + 48 + (s // 2) * 32 + l, s % 2) | (((_byte(blk + 16 + l) >> s) & 1) << 4)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q6_k(blk, s, l):
    half = s // 4  # 128-value halves; low nibbles: 2 x 64 bytes, high 2 bits: 4 planes of 32 bytes
    ql = _nibble(blk + half * 64 + (s % 2) * 32 + l, (s // 2) % 2)
    qh = (_byte(blk + 128 + half * 32 + l) >> ((s % 4) * 2)) & 3
    q = (ql | (qh << 4)) - 32
    sc = _signed(_byte(blk + 192 + 2 * s + l // 16))
    return _f16(blk + 208) * sc.to(tl.float32) * q.to(tl.float32)


@triton.jit
def _iq4_nl(blk, s, l, vals):
    return _f16(blk) * tl.load(vals + _nibble(blk + 2 + l % 16, l // 16))


@triton.jit
def _iq4_xs(blk, s, l, vals):
    high = ((_byte(blk + 2) | (_byte(blk + 3) << 8)) >> (s * 2)) & 3
    sc = (_nibble(blk + 4 + s // 2, s % 2) | (high << 4)) - 32
    idx = _nibble(blk + 8 + s * 16 + l % 16, l // 16)
    return (_f16(blk) * sc.to(tl.float32)) * tl.load(vals + idx)


@triton.jit
def _mxfp4(blk, s, l, vals):
    e = _byte(blk)
    half_scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return half_scale * tl.load(vals + _nibble(blk + 1 + l % 16, l // 16))


@triton.jit
def _sign(signs, index, bit):
    """+-1: bit `bit` of 7-bit sign pattern `index` (float32 [128, 8] table)."""
    return tl.load(signs + index * 8 + bit)


@triton.jit
def _iq2_xxs(blk, s, l, grid, signs):
    sub = blk + 2 + s * 8  # 4 grid bytes, then a u32: 4-bit scale over four 7-bit sign indices
    aux = _u32(sub + 4)
    db = _f16(blk) * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
    g = l // 8
    sidx = ((aux >> (g * 7).to(tl.uint32)) & 0x7F).to(tl.int32)
    return db * tl.load(grid + _byte(sub + g) * 8 + l % 8) * _sign(signs, sidx, l % 8)


@triton.jit
def _iq2_xs(blk, s, l, grid, signs):
    at = blk + 2 + (s * 4 + l // 8) * 2
    q = _byte(at) | (_byte(at + 1) << 8)  # 9-bit grid index | 7-bit sign index << 9
    db = _f16(blk) * (0.5 + _nibble(blk + 66 + s, l // 16).to(tl.float32)) * 0.25
    return db * tl.load(grid + (q & 511) * 8 + l % 8) * _sign(signs, q >> 9, l % 8)


@triton.jit
def _iq3_xxs(blk, s, l, grid, signs):
    aux = _u32(blk + 66 + s * 4)
    db = _f16(blk) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    sidx = ((aux >> ((l // 8) * 7).to(tl.uint32)) & 0x7F).to(tl.int32)
    return db * tl.load(grid + _byte(blk + 2 + s * 8 + l // 4) * 4 + l % 4) * _sign(signs, sidx, l % 8)


@triton.jit
def decode(blk, s, l, grid, signs, vals, QTYPE: tl.constexpr):
    """float32 values of ggml type QTYPE: value l of 32-value group s of the block at blk.

    For the 32-value types s is unused (each group is a block of its own, and blk says which).
    """
    if QTYPE == Q8_0:
        w = _q8_0(blk, s, l)
    elif QTYPE == Q4_0:
        w = _q4_0(blk, s, l)
    elif QTYPE == Q4_1:
        w = _q4_1(blk, s, l)
    elif QTYPE == Q5_0:
        w = _q5_0(blk, s, l)
    elif QTYPE == Q5_1:
        w = _q5_1(blk, s, l)
    elif QTYPE == Q2_K:
        w = _q2_k(blk, s, l)
    elif QTYPE == Q3_K:
        w = _q3_k(blk, s, l)
    elif QTYPE == Q4_K:
        w = _q4_k(blk, s, l)
    elif QTYPE == Q5_K:
        w = _q5_k(blk, s, l)
    elif QTYPE == Q6_K:
        w = _q6_k(blk, s, l)
    elif QTYPE == IQ4_NL:
        w = _iq4_nl(blk, s, l, vals)
    elif QTYPE == IQ4_XS:
        w = _iq4_xs(blk, s, l, vals)
    elif QTYPE == MXFP4:
        w = _mxfp4(blk, s, l, vals)
    elif QTYPE == IQ2_XXS:
        w = _iq2_xxs(blk, s, l, grid, signs)
    elif QTYPE == IQ2_XS:
        w = _iq2_xs(blk, s, l, grid, signs)
    else:
        tl.static_assert(QTYPE == IQ3_XXS, "no Triton decoder for this ggml type")
        w = _iq3_xxs(blk, s, l, grid, signs)
    return w
