"""Triton kernels over ggml blocks: `x @ W.T`, and SwiGLU experts for many (token, expert) pairs.

Every kernel reduces rows of W against one row of x with `_dot_rows`, which walks the row in
BK-value steps, decodes a (BN, BK / 32, 32) tile of weights in registers (`decode`) and never
writes floats back: an expert is read once, in its stored size. One program computes BN outputs of
one row of x; a small batch re-reads W from L2, which is what decode-sized batches want.

The grouped expert product takes the pairs' weights where they already are (cache slots, or
stacked experts on the device): per projection a base uint8 tensor plus one byte offset per
pair. One launch computes silu(gate x) * (up x) for every pair, a second one the down product
scaled by the pair's router weight; the caller sums pairs into tokens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from strata import quant
from strata.kernels.gpu.decode import WORD, decode
from strata.quant import iquants, mxfp4

BK = 256  # weight values decoded per step: one k-/i-quant super-block, eight 32-value blocks


def block_rows() -> int:
    """Output rows per program: 8 on a GPU (sm_90 builds then take 32-96 registers a thread for
    every type, see `compile_check`; bench/gpu_check.py times 4, 8 and 16 on the device); 128
    under the interpreter, which runs one program at a time in Python: fewer, larger ones win."""
    return 128 if _interpreted() else 8


@triton.jit
def _halve(v, BN: tl.constexpr, H: tl.constexpr):
    """(BN, 2H) -> (BN, H): adjacent pairs added."""
    a, b = tl.split(tl.reshape(v, (BN, H, 2)))
    return a + b


@triton.jit
def _tile_sums(t, BN: tl.constexpr, N: tl.constexpr, INTERP: tl.constexpr):
    """float32 (BN,): each row's sum of a (BN, ..., ...) tile of N values a row. Compiled, `tl.sum`;
    under the interpreter pairwise adds (`tl.split`), because `tl.sum` is written in Triton itself and,
    when triton was imported before TRITON_INTERPRET was set, stays a compiled-mode function the
    interpreter refuses to call."""
    if INTERP:
        tl.static_assert(N == 256, "the interpreter's sums are written out for a 256-value step")
        v = tl.reshape(t, (BN, N))
        v = _halve(_halve(_halve(_halve(_halve(_halve(_halve(_halve(v, BN, 128), BN, 64), BN, 32), BN, 16),
                                         BN, 8), BN, 4), BN, 2), BN, 1)
        out = tl.reshape(v, (BN,))
    else:
        out = tl.sum(tl.reshape(t, (BN, N)), 1)
    return out


@triton.jit
def _dot_rows(x_row, w_rows, K, grid, signs, vals, QTYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, W: tl.constexpr, INTERP: tl.constexpr):
    """float32 (BN,): each of BN weight rows (pointers w_rows, (BN, 1)) dotted with x_row (K values).

    A step covers BK values as (BK / 32) groups of 32: one super-block of a 256-value type,
    or BK / 32 blocks of a 32-value one; W: the decoders' word size (`decode.WORD`).
    """
    NG: tl.constexpr = BK // 32
    s = tl.arange(0, NG)[None, :, None]  # (1, NG, 1): group
    l = tl.arange(0, 32)[None, None, :]  # (1, 1, 32): value in the group
    rows = w_rows[:, :, None]  # (BN, 1, 1)
    acc = tl.full([BN], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + s * 32 + l  # (1, NG, 32)
        inside = k < K
        xv = tl.load(x_row + k, mask=inside, other=0.0).to(tl.float32)
        if QK == 32:  # past the end: decode the last real block, multiply it by 0
            blk = rows + tl.minimum(k0 // 32 + s, K // 32 - 1) * TS  # (BN, NG, 1)
        else:
            tl.static_assert(QK == BK, "a step must cover one super-block")
            blk = rows + (k0 // QK) * TS  # (BN, 1, 1)
        w = decode(blk, s, l, grid, signs, vals, QTYPE, W)  # (BN, NG, 32)
        acc += _tile_sums(tl.where(inside, w * xv, 0.0), BN, BK, INTERP)
    return acc


@triton.jit
def _row_pointers(base, n0, N, row_bytes, BN: tl.constexpr):
    """(BN, 1) pointers to rows n0.. of a weight; rows past N repeat the last one (stores are masked)."""
    rows = tl.minimum(n0 + tl.arange(0, BN), N - 1)
    return base + rows.to(tl.int64)[:, None] * row_bytes


@triton.jit
def _qmv_kernel(x, w, out, tables, N, K, row_bytes, x_stride, out_stride,
                QTYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                W: tl.constexpr, INTERP: tl.constexpr):
    """out[b, n] = (W x_b)[n] for this program's row b of x and BN rows n of W."""
    n0 = tl.program_id(0) * BN
    b = tl.program_id(1).to(tl.int64)
    w_rows = _row_pointers(w, n0, N, row_bytes, BN)
    acc = _dot_rows(x + b * x_stride, w_rows, K, tables, tables + 4096, tables + 6144, QTYPE, QK, TS, BN, BK, W, INTERP)
    rows = n0 + tl.arange(0, BN)
    tl.store(out + b * out_stride + rows, acc, mask=rows < N)


@triton.jit
def _gate_up_kernel(x, tok, gate, gate_off, up, up_off, h, g_tables, u_tables, F, H, g_row_bytes, u_row_bytes,
                    x_stride, GT: tl.constexpr, G_QK: tl.constexpr, G_TS: tl.constexpr, G_W: tl.constexpr,
                    UT: tl.constexpr, U_QK: tl.constexpr, U_TS: tl.constexpr, U_W: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, INTERP: tl.constexpr):
    """h[p, n] = silu(gate_p x_t) * (up_p x_t) for pair p = (token t, expert), n in this program's rows."""
    p = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BN
    x_row = x + tl.load(tok + p) * x_stride
    g_rows = _row_pointers(gate + tl.load(gate_off + p), n0, F, g_row_bytes, BN)
    u_rows = _row_pointers(up + tl.load(up_off + p), n0, F, u_row_bytes, BN)
    g = _dot_rows(x_row, g_rows, H, g_tables, g_tables + 4096, g_tables + 6144, GT, G_QK, G_TS, BN, BK, G_W, INTERP)
    u = _dot_rows(x_row, u_rows, H, u_tables, u_tables + 4096, u_tables + 6144, UT, U_QK, U_TS, BN, BK, U_W, INTERP)
    rows = n0 + tl.arange(0, BN)
    tl.store(h + p * F + rows, g / (1.0 + tl.exp(-g)) * u, mask=rows < F)


@triton.jit
def _down_kernel(h, down, down_off, scale, y, tables, F, H, row_bytes,
                 QTYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 W: tl.constexpr, INTERP: tl.constexpr):
    """y[p, n] = scale[p] * (down_p h_p)[n]."""
    p = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BN
    rows_ptr = _row_pointers(down + tl.load(down_off + p), n0, H, row_bytes, BN)
    acc = _dot_rows(h + p * F, rows_ptr, F, tables, tables + 4096, tables + 6144, QTYPE, QK, TS, BN, BK, W, INTERP)
    rows = n0 + tl.arange(0, BN)
    tl.store(y + p * H + rows, acc * tl.load(scale + p), mask=rows < H)


@triton.jit
def _qmm_kernel(x, w, out, tables, M, N, K, row_bytes, x_stride, out_stride,
                QTYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, DOT: tl.constexpr, W: tl.constexpr):
    """out[m, n] = (x_m . W_n) for a BM x BN tile (prefill): each step decodes a (BN, BK) tile of W
    once, in registers, and multiplies it into BM rows of x with `tl.dot` (tensor cores), so W is
    read once per BM rows and never written back as floats. DOT: 0 float32 (IEEE), 1 bfloat16,
    2 float16, the activations' dtype; the decoded weights are rounded to it, as dequantizing to
    that dtype rounds them."""
    n0 = tl.program_id(0) * BN
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    NG: tl.constexpr = BK // 32
    s = tl.arange(0, NG)[None, :, None]
    l = tl.arange(0, 32)[None, None, :]
    rows = _row_pointers(w, n0, N, row_bytes, BN)[:, :, None]  # (BN, 1, 1)
    kk = tl.arange(0, BK)
    x_rows = x + tl.minimum(m, M - 1).to(tl.int64)[:, None] * x_stride  # (BM, 1); rows past M repeat, unstored
    acc = tl.full([BM, BN], 0.0, tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + s * 32 + l
        if QK == 32:
            blk = rows + tl.minimum(k0 // 32 + s, K // 32 - 1) * TS
        else:
            tl.static_assert(QK == BK, "a step must cover one super-block")
            blk = rows + (k0 // QK) * TS
        wt = tl.reshape(tl.where(k < K, decode(blk, s, l, tables, tables + 4096, tables + 6144, QTYPE, W), 0.0),
                        (BN, BK))
        xt = tl.load(x_rows + (k0 + kk)[None, :], mask=(k0 + kk)[None, :] < K, other=0.0)  # (BM, BK)
        if DOT == 1:
            acc += tl.dot(xt.to(tl.bfloat16), tl.trans(wt.to(tl.bfloat16)))
        elif DOT == 3:  # bf16 under the interpreter: the same products, exact in float32 (see DOT_TYPES)
            acc += tl.dot(xt.to(tl.bfloat16).to(tl.float32), tl.trans(wt.to(tl.bfloat16).to(tl.float32)),
                          input_precision="ieee")
        elif DOT == 2:
            acc += tl.dot(xt.to(tl.float16), tl.trans(wt.to(tl.float16)))
        else:
            acc += tl.dot(xt.to(tl.float32), tl.trans(wt), input_precision="ieee")
    cols = n0 + tl.arange(0, BN)
    tl.store(out + m.to(tl.int64)[:, None] * out_stride + cols[None, :], acc,
             mask=(m[:, None] < M) & (cols[None, :] < N))


# ------------------------------------------------------------------------------ lookup tables

_GRIDS = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS")
_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def tables(qtype, device: torch.device) -> torch.Tensor:
    """One float32 buffer per (type, device): grid at 0, sign patterns at 4096, values at 6144.

    The biggest grid (IQ2_XS, 512 x 8) fills the first 4096 entries; the 128 x 8 sign table
    fits below 6144; the 16 IQ4 or E2M1 values follow. Uploaded once.
    """
    q = quant.get(qtype)
    key = (int(q.ggml_type), device)
    buf = _TABLES.get(key)
    if buf is None:
        buf = torch.zeros(6144 + 16, dtype=torch.float32)
        if q.name in _GRIDS:
            g = iquants._grid(q.name, torch.device("cpu")).reshape(-1)
            buf[:g.numel()] = g
            buf[4096:4096 + 1024] = iquants._ksigns(torch.device("cpu")).reshape(-1)
        elif q.name in ("IQ4_NL", "IQ4_XS"):
            buf[6144:] = iquants._iq4_values(torch.device("cpu"))
        elif q.name == "MXFP4":
            buf[6144:] = mxfp4._e2m1(torch.device("cpu"))
        buf = _TABLES[key] = buf.to(device)
    return buf


def _type_args(qtype) -> tuple[int, int, int]:
    q = quant.get(qtype)
    return int(q.ggml_type), q.block_size, q.type_size


def word(qtype, *byte_offsets: int) -> int:
    """The decoders' word size for `qtype`: its layout's (`decode.WORD`), halved until it divides every
    address and byte count given (a view at an odd offset, rows of an odd number of blocks), since a
    misaligned word load faults on the device."""
    w = WORD[quant.get(qtype).ggml_type]
    while w > 1 and any(int(o) % w for o in byte_offsets):
        w //= 2
    return w


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------ launchers


def qmatmul(x: torch.Tensor, raw: torch.Tensor, qtype, shape: tuple[int, int], bn: int | None = None) -> torch.Tensor:
    """float32 (B, N) = x (B, K) @ W.T, W (N, K) stored as ggml blocks in uint8 `raw` (N rows)."""
    n, k = shape
    bn = bn or block_rows()
    qt, qk, ts = _type_args(qtype)
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0 or n == 0:
        return out
    row_bytes = k // qk * ts
    _qmv_kernel[(triton.cdiv(n, bn), x.shape[0])](
        x, raw, out, tables(qtype, x.device), n, k, row_bytes, x.stride(0), out.stride(0),
        QTYPE=qt, QK=qk, TS=ts, BN=bn, BK=BK, W=word(qtype, raw.data_ptr(), row_bytes), INTERP=_interpreted())
    return out


# the prefill kernel's DOT per activation dtype. Triton 3.9's interpreter multiplies bfloat16 tiles
# as their raw uint16 bits, so under it bf16 takes DOT 3: the same bf16-rounded operands multiplied
# in float32, where a product of two bf16 values is exact, as the tensor cores' fp32 accumulation is
DOT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _dot_type(dtype: torch.dtype) -> int:
    dot = DOT_TYPES.get(dtype, 0)
    return 3 if dot == 1 and _interpreted() else dot


def batched_tile() -> tuple[int, int]:
    """(BM, BN) of the prefill kernel: 32 x 32 on a GPU (a 32 x 256 decoded tile in registers, see
    `compile_check`); 64 x 64 under the interpreter, where fewer, larger programs win."""
    return (64, 64) if _interpreted() else (32, 32)


def qmatmul_batched(x: torch.Tensor, raw: torch.Tensor, qtype, shape: tuple[int, int],
                    tile: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 (B, N) = x (B, K) @ W.T for many rows (prefill), W's blocks decoded per tile; x in
    float32, bfloat16 or float16 (the dot's input type)."""
    n, k = shape
    bm, bn = tile or batched_tile()
    qt, qk, ts = _type_args(qtype)
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0 or n == 0:
        return out
    row_bytes = k // qk * ts
    _qmm_kernel[(triton.cdiv(n, bn), triton.cdiv(x.shape[0], bm))](
        x, raw, out, tables(qtype, x.device), x.shape[0], n, k, row_bytes, x.stride(0), out.stride(0),
        QTYPE=qt, QK=qk, TS=ts, BM=bm, BN=bn, BK=BK, DOT=_dot_type(x.dtype), W=word(qtype, raw.data_ptr(), row_bytes),
        num_warps=8)
    return out


def grouped_swiglu(x: torch.Tensor, tok: torch.Tensor, scale: torch.Tensor, sources, parts,
                   bn: int | None = None, offset_align=(1, 1, 1)) -> torch.Tensor:
    """float32 (P, H): pair p's expert applied to x[tok[p]], times scale[p].

    sources: per projection (gate, up, down) a (uint8 base tensor, int64 (P,) byte offsets);
    parts: the layer's three `Part`s (type and [out, in] shape of one expert's projection);
    offset_align: per projection a number every offset is a multiple of (the offsets are on the
    device, so the host is told rather than reading them), for the decoders' word size.
    """
    (gate, g_off), (up, u_off), (down, d_off) = sources
    f, hidden = parts[0].shape
    bn = bn or block_rows()
    n_pairs = tok.shape[0]
    x = x.contiguous()
    h = torch.empty(n_pairs, f, dtype=torch.float32, device=x.device)
    y = torch.empty(n_pairs, hidden, dtype=torch.float32, device=x.device)
    if n_pairs == 0:
        return y
    (gt, gqk, gts), (ut, uqk, uts), (dt, dqk, dts) = (_type_args(p.qtype) for p in parts)
    g_row, u_row, d_row = hidden // gqk * gts, hidden // uqk * uts, f // dqk * dts
    g_w, u_w, d_w = (word(p.qtype, base.data_ptr(), row, align)
                     for p, base, row, align in zip(parts, (gate, up, down), (g_row, u_row, d_row), offset_align))
    interp = _interpreted()
    _gate_up_kernel[(n_pairs, triton.cdiv(f, bn))](
        x, tok, gate, g_off, up, u_off, h, tables(gt, x.device), tables(ut, x.device), f, hidden,
        g_row, u_row, x.stride(0),
        GT=gt, G_QK=gqk, G_TS=gts, G_W=g_w, UT=ut, U_QK=uqk, U_TS=uts, U_W=u_w, BN=bn, BK=BK, INTERP=interp)
    _down_kernel[(n_pairs, triton.cdiv(hidden, bn))](
        h, down, d_off, scale.to(torch.float32).contiguous(), y, tables(dt, x.device), f, hidden,
        d_row, QTYPE=dt, QK=dqk, TS=dts, BN=bn, BK=BK, W=d_w, INTERP=interp)
    return y
