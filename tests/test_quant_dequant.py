"""strata.quant must decode every ggml type bit-for-bit like gguf-py's numpy reference."""

from __future__ import annotations

import warnings

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

import strata.quant as sq
from strata.errors import StrataError, UnsupportedQuantType

# Types with no decoder in gguf-py: checked against numpy's own astype instead.
NUMPY_CAST = {T.F64: np.float64, T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64}
ALL = list(sq.SUPPORTED)
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4]

# Byte offsets of the f16 scale fields in each block; random bytes there can be NaN/inf.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0],
    T.IQ1_S: [0], T.IQ4_NL: [0], T.IQ4_XS: [0], T.TQ1_0: [52], T.TQ2_0: [64],
    T.F16: [0],
}  # fmt: skip


def reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    """What gguf-py (or numpy, for types gguf-py leaves out) makes of these bytes."""
    with np.errstate(all="ignore"):
        if qtype in NUMPY_CAST:
            return raw.view(NUMPY_CAST[qtype]).astype(np.float32)
        return gguf.quants.dequantize(raw, qtype)


def assert_bit_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    got = ours.cpu().numpy()
    assert got.shape == ref.shape
    ref = np.ascontiguousarray(ref, dtype=np.float32)
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} of {same.size} values differ, first at {np.argwhere(~same)[0]}"


def finite_f16_bits(rng: np.random.Generator, size) -> np.ndarray:
    """Uniformly random f16 bit patterns (subnormals and extremes included) that are not inf/NaN."""
    bits = rng.integers(0, 1 << 16, size=size, dtype=np.uint16)
    return np.where((bits & 0x7C00) == 0x7C00, bits ^ 0x4000, bits).astype(np.uint16)


def random_blocks(qtype: T, n_blocks: int, rng: np.random.Generator, finite: bool) -> np.ndarray:
    """uint8 [n_blocks, type_size] of random bytes; with `finite`, every f16 scale is finite."""
    _, ts = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    if not finite:
        return b
    for off in F16_FIELDS.get(qtype, []):
        b[:, off : off + 2] = finite_f16_bits(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.IQ1_M:  # the f16 scale is split over the top nibbles of 4 little-endian u16s
        d = finite_f16_bits(rng, n_blocks).astype(np.uint16)
        words = b[:, 48:56].copy().view(np.uint16)  # [n, 4]
        for i, shift in enumerate([0, 4, 8, 12]):  # word i carries bits 4i..4i+3
            words[:, i] = (words[:, i] & 0x0FFF) | (((d >> shift) & 0xF) << 12)
        b[:, 48:56] = words.view(np.uint8)
    if qtype == T.MXFP4:  # E8M0 scales up to 2^127 times a value of 6 overflow float32
        b[:, 0] = rng.integers(0, 0xF9, size=n_blocks)
    if qtype in (T.F32, T.BF16, T.F64):  # make plain floats finite by clearing the exponent's top bit
        width = {T.F32: 4, T.BF16: 2, T.F64: 8}[qtype]
        b[:, width - 1] &= 0xBF
    return b


def make_shape(bs: int, lead: list[int], blocks_per_row: int) -> tuple[int, ...]:
    return (*lead, blocks_per_row * bs)


# ----------------------------------------------------------------- random bytes, every type


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    blocks_per_row=st.integers(1, 3),
    finite=st.booleans(),
)
def test_random_blocks_match_gguf(qtype, seed, lead, blocks_per_row, finite):
    bs, ts = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    shape = make_shape(bs, lead, blocks_per_row)
    n_rows = int(np.prod(shape[:-1]))
    raw = random_blocks(qtype, n_rows * blocks_per_row, rng, finite).reshape(n_rows, blocks_per_row * ts)
    ref = reference(raw, qtype).reshape(shape)  # [rows, values_per_row] -> logical shape
    assert_bit_equal(sq.dequantize(raw, qtype, shape), ref)
    if finite and qtype not in (T.F16,):
        assert np.isfinite(ref).all()


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", range(4))
def test_many_blocks_as_torch_input(qtype, seed):
    """Same, with a flat torch uint8 tensor and enough blocks to hit most byte values per field."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1000 + seed)
    n_blocks = max(7, 4096 // ts) | 1  # odd
    raw = random_blocks(qtype, n_blocks, rng, finite=bool(seed % 2))
    ref = reference(raw, qtype).reshape(n_blocks, bs)
    flat = torch.from_numpy(raw.reshape(-1))
    if seed >= 2:  # a slice of a bigger buffer at an odd offset: multi-byte fields are misaligned
        flat = torch.cat([torch.zeros(seed + 1, dtype=torch.uint8), flat])[seed + 1 :]
    ours = sq.dequantize(flat, qtype, (n_blocks, bs))
    assert_bit_equal(ours, ref)


# ----------------------------------------------------------------- quantized real-looking data


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", range(6))
def test_quantized_floats_match_gguf(qtype, seed):
    bs, _ = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 4)), int(rng.integers(1, 6)), max(bs, 32) * int(rng.integers(1, 4)))
    values = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 3)).astype(np.float32)
    if seed == 0:
        values[..., : shape[-1] // 2] = 0.0  # all-zero blocks
    q = sq.quantize_reference(values, qtype)
    ours = sq.dequantize(q, qtype, shape)
    assert_bit_equal(ours, reference(q, qtype).reshape(shape))
    if qtype in (T.F32, T.F16, T.BF16, T.Q8_0):  # fine types should be close to the input
        assert np.allclose(ours.numpy(), values, rtol=2e-2, atol=np.abs(values).max() * 1e-2)


# ----------------------------------------------------------------- exhaustive scale / value bytes


@pytest.mark.parametrize("qtype", [T.F16, T.BF16], ids=lambda t: t.name)
def test_every_16_bit_pattern(qtype):
    raw = np.arange(1 << 16, dtype=np.uint16).view(np.uint8)
    assert_bit_equal(sq.dequantize(raw, qtype, (1 << 16,)), reference(raw, qtype))


@pytest.mark.parametrize("qtype", [T.MXFP4, T.NVFP4, T.Q8_0, T.IQ4_NL], ids=lambda t: t.name)
def test_every_scale_byte(qtype):
    """Each value of the first byte (a whole E8M0/UE4M3 scale, or half an f16) across 256 blocks."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(256, ts), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    if qtype == T.NVFP4:
        raw[:, 1:4] = np.arange(256).reshape(256, 1)
    assert_bit_equal(sq.dequantize(raw, qtype, (256, bs)), reference(raw, qtype).reshape(256, bs))


# ----------------------------------------------------------------- interface


def test_quant_type_attributes():
    for t in ALL:
        q = sq.get(t)
        assert q.ggml_type == t and (q.block_size, q.type_size) == GGML_QUANT_SIZES[t]
        out = q.dequantize_blocks(torch.zeros((3, q.type_size), dtype=torch.uint8))
        assert out.dtype == torch.float32 and out.shape == (3, q.block_size)
        assert sq.row_bytes(t, 4 * q.block_size) == 4 * q.type_size
        assert sq.row_bytes(t, 4 * q.block_size) == gguf.quants.quant_shape_to_byte_shape((4 * q.block_size,), t)[0]


def test_get_accepts_ids_and_names():
    assert sq.get(int(T.Q4_K)) is sq.get(T.Q4_K) is sq.get("q4_k")


@pytest.mark.parametrize("qtype", [T.Q8_K, T.Q8_1, T.Q1_0, 999, "Q9_Z"], ids=str)
def test_unsupported_type_is_named(qtype):
    with pytest.raises(UnsupportedQuantType) as e:
        sq.get(qtype)
    msg = str(e.value)
    name = qtype.name if isinstance(qtype, T) else str(qtype)
    assert name in msg and "Q4_K" in msg and "IQ2_XXS" in msg and "\n" not in msg
    with pytest.raises(UnsupportedQuantType):
        sq.dequantize(np.zeros(292, np.uint8), qtype, (256,))


def test_wrong_byte_length_is_clear():
    raw = np.zeros((2, 144), np.uint8)  # two Q4_K blocks
    with pytest.raises(StrataError, match=r"Q4_K tensor of shape \[3, 256\] needs 432 bytes, got 288"):
        sq.dequantize(raw, T.Q4_K, (3, 256))
    with pytest.raises(StrataError, match="not a multiple of the block size 256"):
        sq.dequantize(raw, T.Q4_K, (2, 128))
    with pytest.raises(StrataError, match="multiple of 32"):
        sq.row_bytes(T.Q8_0, 48)


def test_empty_tensor():
    for t in ALL:
        bs = sq.get(t).block_size
        out = sq.dequantize(np.zeros((0,), np.uint8), t, (0, bs))
        assert out.shape == (0, bs) and out.dtype == torch.float32


def test_read_only_memmap_and_float_arrays(tmp_path):
    """gguf's reader yields read-only memmaps, and typed arrays for F32/F16: both are just bytes."""
    values = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    q = sq.quantize_reference(values, T.Q8_0)
    path = tmp_path / "q.bin"
    q.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r").reshape(q.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bit_equal(sq.dequantize(mm, T.Q8_0, (5, 64)), reference(q, T.Q8_0))
    assert torch.equal(sq.dequantize(values, T.F32, (5, 64)), torch.from_numpy(values))
    mm32 = np.memmap(tmp_path / "f.bin", dtype=np.float32, mode="w+", shape=values.shape)
    mm32[:] = values
    mm32.flush()
    mm32 = np.memmap(tmp_path / "f.bin", dtype=np.float32, mode="r", shape=values.shape)
    out = sq.dequantize(mm32, T.F32, (5, 64))
    out += 1  # must be a private copy, not the read-only mapping
    assert np.array_equal(mm32, values)
    h = values.astype(np.float16)
    assert torch.equal(sq.dequantize(h, T.F16, (5, 64)), torch.from_numpy(h.astype(np.float32)))


def test_gguf_file_round_trip(tmp_path):
    """Write quantized tensors with GGUFWriter, read them with GGUFReader, decode as the loader will."""
    rng = np.random.default_rng(11)
    tensors = {f"t.{t.name}": (t, rng.standard_normal((3, 2, 256)).astype(np.float32)) for t in QUANTIZABLE}
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    for name, (t, v) in tensors.items():
        q = sq.quantize_reference(v, t)
        w.add_tensor(name, q, raw_dtype=None if t in (T.F32, T.F16) else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for rt in gguf.GGUFReader(str(path)).tensors:
        t, v = tensors[rt.name]
        shape = tuple(int(x) for x in reversed(rt.shape))  # ggml lists ne innermost first
        ours = sq.dequantize(rt.data, rt.tensor_type, shape)
        assert ours.shape == v.shape
        assert_bit_equal(ours, reference(sq.quantize_reference(v, t), t).reshape(v.shape))


def test_quantize_reference_unsupported():
    with pytest.raises(UnsupportedQuantType, match="Q4_K"):
        sq.quantize_reference(np.zeros((1, 256), np.float32), T.Q4_K)
    with pytest.raises(StrataError, match="multiple of 32"):
        sq.quantize_reference(np.zeros((1, 48), np.float32), T.Q8_0)


# ----------------------------------------------------------------- FP8 (safetensors, not GGUF)


def test_fp8_every_byte_matches_torch():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = sq.fp8_e4m3_to_float32(raw)
    ref = raw.view(torch.float8_e4m3fn).to(torch.float32)
    assert_bit_equal(ours, ref.numpy())
    assert torch.isnan(ours).sum() == 2  # 0x7F, 0xFF; E4M3FN has no infinities
    assert_bit_equal(sq.fp8_e4m3_to_float32(raw.view(torch.float8_e4m3fn)), ours.numpy())


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((128, 256), (128, 128)), ((7, 5), (2, 3))])
def test_fp8_block_scales(shape, block):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    s = torch.rand(grid, generator=g) * 1e-2
    ours = sq.fp8_e4m3_to_float32(w.view(torch.uint8), s, block)
    ref = torch.empty(shape)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            ref[tile] = w[tile].to(torch.float32) * s[i, j]
    assert_bit_equal(ours, ref.numpy())
    assert_bit_equal(sq.fp8_e4m3_to_float32(w, 0.5), (w.to(torch.float32) * 0.5).numpy())
    with pytest.raises(StrataError, match="expected"):
        sq.fp8_e4m3_to_float32(w, s[:, :1].repeat(2, 2), block)


# ----------------------------------------------------------------- GPU (same bits as the CPU path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype):
    bs, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 513, np.random.default_rng(5), finite=False)
    cpu = sq.dequantize(raw, qtype, (513, bs))
    gpu = sq.dequantize(torch.from_numpy(raw).cuda(), qtype, (513, bs))
    assert gpu.is_cuda
    assert_bit_equal(gpu, cpu.numpy())
