"""Triton decoders: one ggml value at a time, straight from its block's bytes.

Each `_<type>(blk, j, ...)` takes a tile of pointers to the first byte of the block holding
each value and the value's index `j` inside that block, and returns the values as float32,
by the same formulas as `strata.quant` (which is bit-exact against gguf-py). Bytes a tile
shares (a block's scale) are loaded once per value; the loads hit the same cache lines, so
DRAM traffic is still each byte once. `decode` picks the decoder from the ggml type id, a
compile-time constant, so every kernel is specialised to one type.
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
def _q8_0(blk, j):
    return _f16(blk) * _signed(_byte(blk + 2 + j)).to(tl.float32)


@triton.jit
def _q4_0(blk, j):
    q = _nibble(blk + 2 + j % 16, j // 16) - 8
    return _f16(blk) * q.to(tl.float32)


@triton.jit
def _q4_1(blk, j):
    q = _nibble(blk + 4 + j % 16, j // 16)
    return _f16(blk) * q.to(tl.float32) + _f16(blk + 2)


@triton.jit
def _fifth_bit(p, j):
    """Bit j of the little-endian u32 at p (Q5_0/Q5_1)."""
    return (_byte(p + j // 8) >> (j % 8)) & 1


@triton.jit
def _q5_0(blk, j):
    q = (_nibble(blk + 6 + j % 16, j // 16) | (_fifth_bit(blk + 2, j) << 4)) - 16
    return _f16(blk) * q.to(tl.float32)


@triton.jit
def _q5_1(blk, j):
    q = _nibble(blk + 8 + j % 16, j // 16) | (_fifth_bit(blk + 4, j) << 4)
    return _f16(blk) * q.to(tl.float32) + _f16(blk + 2)


@triton.jit
def _q2_k(blk, j):
    s = j // 16  # sub-block of 16 values; quants: 2 halves x 4 bit planes x 32 bytes
    sc = _byte(blk + s)
    q = (_byte(blk + 16 + (j // 128) * 32 + j % 32) >> (((j // 32) % 4) * 2)) & 3
    dl = _f16(blk + 80) * (sc & 0xF).to(tl.float32)
    ml = _f16(blk + 82) * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k(blk, j):
    s = j // 16  # sixteen 6-bit scales: low nibbles in bytes 96-103, top 2 bits in 104-107
    low = _nibble(blk + 96 + s % 8, s // 8)
    high = (_byte(blk + 104 + s % 4) >> ((s // 4) * 2)) & 3
    sc = (low | (high << 4)) - 32
    ql = (_byte(blk + 32 + (j // 128) * 32 + j % 32) >> (((j // 32) % 4) * 2)) & 3
    hm = (_byte(blk + j % 32) >> (j // 32)) & 1  # a set mask bit means "no -4 offset"
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
def _q4_k(blk, j):
    s = j // 32
    sc, mn = _scale_min_k4(blk + 4, s)
    q = _nibble(blk + 16 + (s // 2) * 32 + j % 32, s % 2)
    return _f16(blk) * sc.to(tl.float32) * q.to(tl.float32) - _f16(blk + 2) * mn.to(tl.float32)


@triton.jit
def _q5_k(blk, j):
    s = j // 32
    sc, mn = _scale_min_k4(blk + 4, s)
    q = _nibble(blk + 48 + (s // 2) * 32 + j % 32, s % 2) | (((_byte(blk + 16 + j % 32) >> s) & 1) << 4)
    return _f16(blk) * sc.to(tl.float32) * q.to(tl.float32) - _f16(blk + 2) * mn.to(tl.float32)


@triton.jit
def _q6_k(blk, j):
    half = j // 128
    ql = _nibble(blk + half * 64 + j % 64, (j // 64) % 2)
    qh = (_byte(blk + 128 + half * 32 + j % 32) >> (((j // 32) % 4) * 2)) & 3
    q = (ql | (qh << 4)) - 32
    sc = _signed(_byte(blk + 192 + j // 16))
    return _f16(blk + 208) * sc.to(tl.float32) * q.to(tl.float32)


@triton.jit
def _iq4_nl(blk, j, vals):
    return _f16(blk) * tl.load(vals + _nibble(blk + 2 + j % 16, j // 16))


@triton.jit
def _iq4_xs(blk, j, vals):
    s = j // 32
    high = ((_byte(blk + 2) | (_byte(blk + 3) << 8)) >> (s * 2)) & 3
    sc = (_nibble(blk + 4 + s // 2, s % 2) | (high << 4)) - 32
    idx = _nibble(blk + 8 + s * 16 + j % 16, (j % 32) // 16)
    return _f16(blk) * sc.to(tl.float32) * tl.load(vals + idx)


@triton.jit
def _mxfp4(blk, j, vals):
    e = _byte(blk)
    half_scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
    return half_scale * tl.load(vals + _nibble(blk + 1 + j % 16, j // 16))


@triton.jit
def _sign(signs, index, bit):
    """+-1: bit `bit` of 7-bit sign pattern `index` (float32 [128, 8] table)."""
    return tl.load(signs + index * 8 + bit)


@triton.jit
def _iq2_xxs(blk, j, grid, signs):
    sub = blk + 2 + (j // 32) * 8  # 4 grid bytes, then a u32: 4-bit scale over four 7-bit sign indices
    g = (j % 32) // 8
    aux = _u32(sub + 4)
    db = _f16(blk) * (0.5 + (aux >> 28).to(tl.float32)) * 0.25
    sidx = ((aux >> (g * 7).to(tl.uint32)) & 0x7F).to(tl.int32)
    return db * tl.load(grid + _byte(sub + g) * 8 + j % 8) * _sign(signs, sidx, j % 8)


@triton.jit
def _iq2_xs(blk, j, grid, signs):
    q = _byte(blk + 2 + (j // 8) * 2) | (_byte(blk + 3 + (j // 8) * 2) << 8)  # 9-bit grid | 7-bit signs
    sc = _nibble(blk + 66 + j // 32, (j // 16) % 2)
    db = _f16(blk) * (0.5 + sc.to(tl.float32)) * 0.25
    return db * tl.load(grid + (q & 511) * 8 + j % 8) * _sign(signs, q >> 9, j % 8)


@triton.jit
def _iq3_xxs(blk, j, grid, signs):
    aux = _u32(blk + 66 + (j // 32) * 4)
    db = _f16(blk) * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
    sidx = ((aux >> (((j % 32) // 8) * 7).to(tl.uint32)) & 0x7F).to(tl.int32)
    return db * tl.load(grid + _byte(blk + 2 + j // 4) * 4 + j % 4) * _sign(signs, sidx, j % 8)


@triton.jit
def decode(blk, j, grid, signs, vals, QTYPE: tl.constexpr):
    """float32 values of ggml type QTYPE: blk points at each value's block, j is its index in it."""
    if QTYPE == Q8_0:
        w = _q8_0(blk, j)
    elif QTYPE == Q4_0:
        w = _q4_0(blk, j)
    elif QTYPE == Q4_1:
        w = _q4_1(blk, j)
    elif QTYPE == Q5_0:
        w = _q5_0(blk, j)
    elif QTYPE == Q5_1:
        w = _q5_1(blk, j)
    elif QTYPE == Q2_K:
        w = _q2_k(blk, j)
    elif QTYPE == Q3_K:
        w = _q3_k(blk, j)
    elif QTYPE == Q4_K:
        w = _q4_k(blk, j)
    elif QTYPE == Q5_K:
        w = _q5_k(blk, j)
    elif QTYPE == Q6_K:
        w = _q6_k(blk, j)
    elif QTYPE == IQ4_NL:
        w = _iq4_nl(blk, j, vals)
    elif QTYPE == IQ4_XS:
        w = _iq4_xs(blk, j, vals)
    elif QTYPE == MXFP4:
        w = _mxfp4(blk, j, vals)
    elif QTYPE == IQ2_XXS:
        w = _iq2_xxs(blk, j, grid, signs)
    elif QTYPE == IQ2_XS:
        w = _iq2_xs(blk, j, grid, signs)
    else:
        tl.static_assert(QTYPE == IQ3_XXS, "no Triton decoder for this ggml type")
        w = _iq3_xxs(blk, j, grid, signs)
    return w
