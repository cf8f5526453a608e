"""`strata synth`: a random-weight GGUF with a real model's per-layer shapes, for benchmarks.

    strata synth --like qwen3-30b-a3b --layers 4 --quant Q4_K_M out.gguf

The file is a complete model in llama.cpp's layout (arch qwen3moe for qwen3-30b-a3b, qwen3next
for qwen3-next-80b, qwen4exp for qwen4exp): the real hidden size, heads, experts and expert
width, fewer layers, optionally a smaller vocabulary (--vocab) or fewer experts (--experts, for
small test files), and a small byte-level BPE tokenizer (tokenizer.ggml.model "gpt2") so
llama.cpp accepts it (llama-cpp-python 0.3.36 runs all three; its qwen3next needs the key and
value head widths equal, as the real model has; and at least one attention layer: with --layers
1 to 3 every layer is Gated DeltaNet, Strata runs the file, and llama.cpp aborts at its first
decode with GGML_ASSERT(buffer), its hybrid memory's KV cache having no layer to allocate a
buffer for; `main` says so). qwen4exp files'
n-gram table (`per_layer_token_embd`, layer 1) is small unless --ngram-rows asks for more
(the real one has 320,001,536 rows of 160 values), and they have no MTP block.

Quantized tensors are written block by block without a quantizer: random bytes for the
quants, with every scale field overwritten by a finite, positive value sized so that the
weights come out with an RMS of about 0.02 and mean near zero (`random_blocks`). Any bit
pattern in the quant fields is a valid block, so this is the same set of files a quantizer
could produce, at the speed of a random number generator (gguf-py cannot quantize to K- or
i-quants at all, and is far too slow for gigabytes of experts where it can).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import fields, replace
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from strata import quant
from strata.argparser import ArgumentParser
from strata.errors import BadOption, UnsupportedQuantType
from strata.formats import qwen3moe, qwen3next, qwen4exp
from strata.formats.hparams import RopeConfig
from strata.formats.ngram_hash import NgramHash, head_vocab_sizes, layer_multipliers, padded_rows

WEIGHT_RMS = 0.02

# ----------------------------------------------------------------------------- random blocks

# Each type's f16 scale fields: (byte offset, role). "d" scales the block; "dmin"/"m" are set
# from d so the decoded values are centred (see _centre).
_F16_FIELDS: dict[T, tuple[tuple[int, str], ...]] = {
    T.Q4_0: ((0, "d"),), T.Q4_1: ((0, "d"), (2, "m")), T.Q5_0: ((0, "d"),), T.Q5_1: ((0, "d"), (2, "m")),
    T.Q8_0: ((0, "d"),), T.Q2_K: ((80, "d"), (82, "dmin")), T.Q3_K: ((108, "d"),),
    T.Q4_K: ((0, "d"), (2, "dmin")), T.Q5_K: ((0, "d"), (2, "dmin")), T.Q6_K: ((208, "d"),),
    T.IQ2_XXS: ((0, "d"),), T.IQ2_XS: ((0, "d"),), T.IQ2_S: ((0, "d"),), T.IQ3_XXS: ((0, "d"),),
    T.IQ3_S: ((0, "d"),), T.IQ1_S: ((0, "d"),), T.IQ4_NL: ((0, "d"),), T.IQ4_XS: ((0, "d"),),
}
# dmin / m relative to d: the mean quant value times the mean of (sub-scale / sub-min), so that
# d * sc * q - dmin * mn averages to zero (sc and mn are drawn from the same distribution).
_CENTRE = {T.Q4_1: -7.5, T.Q5_1: -15.5, T.Q2_K: 1.5, T.Q4_K: 7.5, T.Q5_K: 15.5}
RANDOM_BLOCK_TYPES = (*_F16_FIELDS, T.MXFP4)

_UNIT_RMS: dict[T, float] = {}


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random bytes, writable (64-bit draws are the fastest numpy offers)."""
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n]


def _set_scales(blocks: np.ndarray, qtype: T, d: np.ndarray) -> None:
    """Overwrite the scale fields of uint8 [n, type_size] blocks; d: float per block."""
    if qtype == T.MXFP4:  # E8M0 exponent byte: decodes to 2**(e - 128) ("half" convention)
        blocks[:, 0] = np.clip(np.round(np.log2(d)) + 128, 2, 254).astype(np.uint8)
        return
    for offset, role in _F16_FIELDS[qtype]:
        value = d if role == "d" else d * _CENTRE[qtype]
        blocks[:, offset:offset + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _unit_rms(qtype: T) -> float:
    """RMS of values decoded from random blocks whose scale is 1 (measured once per type)."""
    if qtype not in _UNIT_RMS:
        rng = np.random.default_rng(1234)
        q = quant.get(qtype)
        blocks = _random_bytes(rng, 512 * q.type_size).reshape(512, q.type_size)
        _set_scales(blocks, qtype, np.ones(512, np.float32))
        values = q.dequantize_blocks(torch.from_numpy(blocks))
        _UNIT_RMS[qtype] = float(values.pow(2).mean().sqrt())
    return _UNIT_RMS[qtype]


def random_blocks(qtype, n_blocks: int, rng: np.random.Generator, rms: float = WEIGHT_RMS) -> np.ndarray:
    """uint8 [n_blocks, type_size] of valid `qtype` blocks whose values have about this RMS.

    Quant fields are uniform random bits (every pattern is a valid block); scale fields are
    finite: each block's scale is the target scale times a factor in [0.5, 1.5).
    """
    qtype = T(int(qtype))
    if qtype not in RANDOM_BLOCK_TYPES:
        raise UnsupportedQuantType(f"synth cannot build random {qtype.name} blocks",
                                   "supported: " + ", ".join(t.name for t in RANDOM_BLOCK_TYPES))
    ts = quant.get(qtype).type_size
    blocks = _random_bytes(rng, n_blocks * ts).reshape(n_blocks, ts)
    scale = rms / _unit_rms(qtype)
    jitter = rng.random(n_blocks, dtype=np.float32) + np.float32(0.5)
    _set_scales(blocks, qtype, (scale * jitter).astype(np.float32))
    return blocks


def random_f16(rng: np.random.Generator, n: int, rms: float = WEIGHT_RMS) -> np.ndarray:
    """n float16 values from random bits: random sign, mantissa and exponent LSB, so magnitudes
    fall in two octaves around `rms` (two in-place passes; no float math)."""
    bits = rng.bit_generator.random_raw((n + 3) // 4).view(np.uint16)[:n]
    base = (int(math.floor(math.log2(rms))) - 1 + 15) & ~1  # even: the random bit 10 adds 0 or 1
    bits &= np.uint16(0x87FF)  # keep sign, exponent LSB, mantissa
    bits |= np.uint16(base << 10)
    return bits.view(np.float16)


# ----------------------------------------------------------------------------- models


def _hash(ngram_size: int, heads_per_ngram: int, vocab: int, base: int) -> NgramHash:
    """transformers' n-gram hash: head h hashes into the h-th prime from `base`."""
    heads = (ngram_size - 1) * heads_per_ngram
    sizes = head_vocab_sizes(base, heads, 0)
    return NgramHash(ngram_size, heads_per_ngram, tuple(layer_multipliers(vocab, ngram_size, 0, 1234)), tuple(sizes),
                     tuple(sum(sizes[:k]) for k in range(heads)), eos=vocab - 1)


def _every_fourth_attention(n: int) -> tuple[bool, ...]:
    """3 Gated DeltaNet layers, then 1 attention layer (full_attention_interval 4)."""
    return tuple((i + 1) % 4 != 0 for i in range(n))


# The real models, each in its own architecture's Config (strata/formats/<arch>.py); `scaled` makes
# the file's config from one: fewer layers, a smaller vocabulary or fewer experts, the same widths.
LIKE = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": qwen3moe.Config(
        vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_size=6144,
        expert_ffn_size=768, n_experts=128, n_experts_used=8, norm_topk_prob=True, rms_eps=1e-6,
        rope=RopeConfig(dim=128, theta=1_000_000.0), context_length=40960),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 3 Gated DeltaNet layers, then 1 gated attention
    "qwen3-next-80b": qwen3next.Config(
        vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=16, n_kv_heads=2, head_dim=256, ffn_size=5120,
        expert_ffn_size=512, shared_ffn_size=512, n_experts=512, n_experts_used=10, norm_topk_prob=True,
        rms_eps=1e-6, rope=RopeConfig(dim=64, theta=10_000_000.0), context_length=262144,
        recurrent=_every_fourth_attention(48), conv_kernel=4, linear_k_heads=16, linear_v_heads=32,
        linear_k_dim=128, linear_v_dim=128),
    # Qwen3.8-Flash-Next (HF qwen4_exp; the flagship issue's reference facts): 3 Gated DeltaNet
    # layers, then 1 QSA layer; 4 hyper-connection streams; an n-gram table on layer 1 of
    # 320,001,536 rows (`ple_rows`) of 160 values, hashed by 3-grams with 8 heads per n-gram order
    # (the moduli here are placeholders: `ngram_hash` sizes them to the table a file holds)
    "qwen4exp": qwen4exp.Config(
        vocab_size=248320, hidden_size=2560, n_layers=48, n_heads=24, n_kv_heads=2, head_dim=256,
        expert_ffn_size=640, shared_ffn_size=640, n_experts=512, n_experts_used=10, norm_topk_prob=True,
        rms_eps=1e-6, rope=RopeConfig(dim=64, theta=10_000_000.0), rope_sections=(11, 11, 10, 0),
        context_length=262144, recurrent=_every_fourth_attention(48), conv_kernel=4, linear_k_heads=16,
        linear_v_heads=48, linear_k_dim=128, linear_v_dim=128, gate_act="sigmoid", hc_count=4, hc_rank=320,
        indexer_heads=4, indexer_dim=128, indexer_budget=2048,
        compress_ratios=tuple(0 if r else 4 for r in _every_fourth_attention(48)), ple_layers=(1,),
        ple_conv_kernel=4, ple_row_dim=160, ple_hash=_hash(3, 8, 248320, 2), ple_rows=320_001_536),
}
FORMATS = {qwen3moe.Config: qwen3moe, qwen3next.Config: qwen3next, qwen4exp.Config: qwen4exp}
SMALL_NGRAM_ROWS = 65536  # the default table: 16 heads of ~4K rows (5.6 MiB at Q4_0)

# --quant name -> (ggml file_type id, chooser(kind, layer, n_layers) -> type)
def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _q4_k_m(kind: str, i: int, n: int) -> T:
    if kind == "output":
        return T.Q6_K
    if kind in ("attn_v", "ffn_down_exps") and _more_bits(i, n):
        return T.Q6_K
    return T.Q4_K


def _iq2_xs(kind: str, i: int, n: int) -> T:
    return {"output": T.Q5_K, "token_embd": T.Q2_K, "attn_v": T.Q4_K, "attn_output": T.Q5_K,
            "ffn_down_exps": T.Q2_K if i < n // 8 else T.IQ2_XS}.get(kind, T.IQ2_XS)


QUANTS = {
    "Q4_K_M": (15, _q4_k_m),
    "IQ2_XS": (20, _iq2_xs),
    "Q8_0": (7, lambda kind, i, n: T.Q8_0),
    "Q4_0": (2, lambda kind, i, n: T.Q6_K if kind == "output" else T.Q4_0),
    "F16": (1, lambda kind, i, n: T.F16),
    "F32": (0, lambda kind, i, n: T.F32),  # exact weights: compare engines without weight rounding
}


# Rows whose width is not a multiple of 256 cannot hold K- or i-quant blocks; llama.cpp then
# falls back to a 32-value type of about the same size (llama_tensor_get_type's fallback).
_FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.IQ4_NL, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
             T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL, T.IQ2_S: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL,
             T.IQ3_S: T.IQ4_NL, T.IQ1_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL}
SMALL_KINDS = ("norm", "router", "conv", "ssm_a", "ssm_dt")  # always F32, as llama.cpp keeps them


def _fits(qtype: T, shape) -> T:
    """qtype, or its fallback when a row of `shape` is not whole blocks of it."""
    if qtype in (T.F32, T.F16) or shape[-1] % quant.get(qtype).block_size == 0:
        return qtype
    return _FALLBACK.get(qtype, T.F16)


def scaled(like, n_layers: int, vocab: int, experts: int | None = None, ngram_rows: int | None = None):
    """The file's config: `like` (a real model's Config, from LIKE) with `n_layers` layers (its layer
    pattern continued), `vocab` tokens and `experts` experts (default: the model's), and for an
    n-gram table the largest hash of at most `ngram_rows` rows (default SMALL_NGRAM_ROWS)."""
    E = experts or like.n_experts
    names = {f.name for f in fields(like)}
    change = dict(vocab_size=vocab, n_layers=n_layers, n_experts=E, n_experts_used=min(like.n_experts_used, E))
    for per_layer in ("recurrent", "compress_ratios"):
        if per_layer in names:
            pattern = getattr(like, per_layer)
            change[per_layer] = tuple(pattern[i % len(pattern)] for i in range(n_layers))
    if "ple_layers" in names:
        ple = tuple(i for i in like.ple_layers if i < n_layers)
        change.update(ple_layers=ple, ple_row_dim=like.ple_row_dim if ple else 0, ple_rows=None,
                      ple_hash=ngram_hash(like, vocab, ngram_rows) if ple else None)
    return replace(like, **change)


def full_attention_interval(like) -> int:
    """The real model's: layer i is full attention when (i + 1) % interval == 0."""
    return next(i + 1 for i, r in enumerate(like.recurrent) if not r)


def tensor_plan(like, n_layers: int, vocab: int, quant_name: str, experts: int | None = None,
                ngram_rows: int | None = None):
    """[(name, torch-order shape, ggml type, kind)] in file order, as llama.cpp names them, for
    `scaled(like, n_layers, vocab, experts, ngram_rows)`."""
    c = scaled(like, n_layers, vocab, experts, ngram_rows)
    if isinstance(c, qwen4exp.Config):
        return _qwen4exp_plan(c, quant_name)
    choose = QUANTS[quant_name][1]
    next_ = isinstance(c, qwen3next.Config)
    h, E, f = c.hidden_size, c.n_experts, c.expert_ffn_size
    shared = c.shared_ffn_size if next_ else 0
    plan = [("token_embd.weight", (vocab, h), choose("token_embd", 0, n_layers), "token_embd")]

    def add(i, name, shape, kind):
        qtype = T.F32 if kind in SMALL_KINDS else _fits(choose(kind, i, n_layers), shape)
        plan.append((f"blk.{i}.{name}", shape, qtype, kind))

    for i in range(n_layers):
        add(i, "attn_norm.weight", (h,), "norm")
        if next_ and c.recurrent[i]:  # Gated DeltaNet
            kd, vd = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim
            conv = 2 * kd + vd
            # llama.cpp's converter splits HF's in_proj_qkvz into these two (its legacy fused
            # `ssm_in` still loads, on llama.cpp's slower path)
            add(i, "attn_qkv.weight", (conv, h), "attn_qkv")
            add(i, "attn_gate.weight", (vd, h), "attn_gate")
            add(i, "ssm_ba.weight", (2 * c.linear_v_heads, h), "ssm_ba")
            add(i, "ssm_conv1d.weight", (conv, c.conv_kernel), "conv")
            add(i, "ssm_dt.bias", (c.linear_v_heads,), "ssm_dt")
            add(i, "ssm_a", (c.linear_v_heads,), "ssm_a")
            add(i, "ssm_norm.weight", (c.linear_v_dim,), "norm")
            add(i, "ssm_out.weight", (h, vd), "ssm_out")
        else:
            gated = 2 if next_ else 1  # qwen3next's attn_q holds [query | gate]
            add(i, "attn_q.weight", (gated * c.n_heads * c.head_dim, h), "attn_q")
            add(i, "attn_k.weight", (c.n_kv_heads * c.head_dim, h), "attn_k")
            add(i, "attn_v.weight", (c.n_kv_heads * c.head_dim, h), "attn_v")
            add(i, "attn_output.weight", (h, c.n_heads * c.head_dim), "attn_output")
            add(i, "attn_q_norm.weight", (c.head_dim,), "norm")
            add(i, "attn_k_norm.weight", (c.head_dim,), "norm")
        add(i, "post_attention_norm.weight" if next_ else "ffn_norm.weight", (h,), "norm")
        add(i, "ffn_gate_inp.weight", (E, h), "router")
        add(i, "ffn_gate_exps.weight", (E, f, h), "ffn_gate_exps")
        add(i, "ffn_up_exps.weight", (E, f, h), "ffn_up_exps")
        add(i, "ffn_down_exps.weight", (E, h, f), "ffn_down_exps")
        if shared:
            add(i, "ffn_gate_inp_shexp.weight", (1, h), "router")
            add(i, "ffn_gate_shexp.weight", (shared, h), "ffn_gate_shexp")
            add(i, "ffn_up_shexp.weight", (shared, h), "ffn_up_shexp")
            add(i, "ffn_down_shexp.weight", (h, shared), "ffn_down_exps")
    plan.append(("output_norm.weight", (h,), T.F32, "norm"))
    plan.append(("output.weight", (vocab, h), choose("output", 0, n_layers), "output"))
    return plan


def _qwen4exp_plan(c: qwen4exp.Config, quant_name: str):
    """qwen4exp's tensors (strata/formats/qwen4exp.py lists the layout): hyper-connection mixers
    around every mixer and MoE (kept F16: their up matrices are 320 wide), Gated DeltaNet or
    QSA, the n-gram table's projections on the PLE layer, and the table itself last."""
    choose = QUANTS[quant_name][1]
    n_layers, vocab = c.n_layers, c.vocab_size
    h, E, f, s = c.hidden_size, c.n_experts, c.expert_ffn_size, c.shared_ffn_size
    width, rank, hc = c.hc_count * h, c.hc_rank, c.hc_count
    plan = [("token_embd.weight", (vocab, h), choose("token_embd", 0, n_layers), "token_embd")]

    def add(name, shape, kind, i=0):
        if kind in SMALL_KINDS:
            qtype = T.F32
        elif kind == "hc":
            qtype = T.F16
        else:
            qtype = _fits(choose(kind, i, n_layers), shape)
        plan.append((name, shape, qtype, kind))

    def mixer(prefix, inject=True):
        add(f"{prefix}_norm.weight", (width,), "norm")
        add(f"{prefix}_down.weight", (rank, width), "hc")
        add(f"{prefix}_up.weight", (width, rank), "hc")
        if inject:
            add(f"{prefix}_inject.weight", (hc, width), "hc")

    kd, vd, nv = c.linear_k_heads * c.linear_k_dim, c.linear_v_heads * c.linear_v_dim, c.linear_v_heads
    for i in range(n_layers):
        p = f"blk.{i}"
        mixer(f"{p}.hc_attn")
        mixer(f"{p}.hc_ffn")
        if c.recurrent[i]:  # Gated DeltaNet
            for name, shape, kind in (("attn_qkv.weight", (2 * kd + vd, h), "attn_qkv"),
                                      ("attn_gate.weight", (vd, h), "attn_gate"),
                                      ("ssm_beta.weight", (nv, h), "ssm_beta"),
                                      ("ssm_alpha.weight", (nv, h), "ssm_alpha"),
                                      ("ssm_conv1d.weight", (2 * kd + vd, c.conv_kernel), "conv"),
                                      ("ssm_dt.bias", (nv,), "ssm_dt"), ("ssm_a", (nv,), "ssm_a"),
                                      ("ssm_norm.weight", (c.linear_v_dim,), "norm"),
                                      ("ssm_out.weight", (h, vd), "ssm_out")):
                add(f"{p}.{name}", shape, kind, i)
        else:  # QSA: gated attention ([query | gate] per head) and its indexer
            hd, ih, idim = c.head_dim, c.indexer_heads, c.indexer_dim
            for name, shape, kind in (("attn_q.weight", (2 * c.n_heads * hd, h), "attn_q"),
                                      ("attn_k.weight", (c.n_kv_heads * hd, h), "attn_k"),
                                      ("attn_v.weight", (c.n_kv_heads * hd, h), "attn_v"),
                                      ("attn_output.weight", (h, c.n_heads * hd), "attn_output"),
                                      ("attn_q_norm.weight", (hd,), "norm"), ("attn_k_norm.weight", (hd,), "norm"),
                                      ("indexer.q_proj.weight", (ih * idim, h), "indexer"),
                                      ("indexer.k_proj.weight", (idim, h), "indexer"),
                                      ("indexer.q_norm.weight", (idim,), "norm"),
                                      ("indexer.k_norm.weight", (idim,), "norm")):
                add(f"{p}.{name}", shape, kind, i)
        if i in c.ple_layers:
            e = c.ple_embed_dim
            for name, shape, kind in (("ple_key.weight", (width, e), "ple"), ("ple_value.weight", (h, e), "ple"),
                                      ("ple_norm_key.weight", (width,), "norm"),
                                      ("ple_norm_query.weight", (width,), "norm"),
                                      ("ple_norm_conv.weight", (width,), "norm"),
                                      ("ple_conv1d.weight", (width, c.ple_conv_kernel), "conv")):
                add(f"{p}.{name}", shape, kind, i)
        for name, shape, kind in (("ffn_gate_inp.weight", (E, h), "router"),
                                  ("ffn_gate_exps.weight", (E, f, h), "ffn_gate_exps"),
                                  ("ffn_up_exps.weight", (E, f, h), "ffn_up_exps"),
                                  ("ffn_down_exps.weight", (E, h, f), "ffn_down_exps"),
                                  ("ffn_gate_shexp.weight", (s, h), "ffn_gate_shexp"),
                                  ("ffn_up_shexp.weight", (s, h), "ffn_up_shexp"),
                                  ("ffn_down_shexp.weight", (h, s), "ffn_down_exps"),
                                  ("ffn_gate_inp_shexp.weight", (1, h), "router")):
            add(f"{p}.{name}", shape, kind, i)
    mixer("output_hc", inject=False)
    add("output.weight", (vocab, h), "output")
    if c.ple_layers:
        rows = padded_rows(c.ple_hash, 128)
        plan.append(("per_layer_token_embd.weight", (rows, c.ple_row_dim), _TABLE_TYPES[quant_name], "ngram"))
    return plan


# The n-gram table's type: rows of 160 values take only 32-value blocks. The real table is
# 28.8 GB for 51.2B values, 4.5 bits each: Q4_0.
_TABLE_TYPES = {"Q4_K_M": T.Q4_0, "IQ2_XS": T.Q4_0, "Q4_0": T.Q4_0, "Q8_0": T.Q8_0, "F16": T.F16, "F32": T.F32}


def ngram_hash(like, vocab: int, rows: int | None = None) -> NgramHash:
    """`like`'s n-gram hash (transformers' construction) for `vocab` tokens, over the largest table
    of at most `rows` rows (default SMALL_NGRAM_ROWS).

    Head h hashes into the h-th prime from a base (the real model's ngram_vocab_size_base is
    20,000,000, which makes 320,001,536 rows padded to 128); the base is the largest whose
    padded table fits, so the real row count gives back the real hash."""
    shape = like.ple_hash
    heads, rows = shape.n_heads, rows or SMALL_NGRAM_ROWS

    def make(base: int) -> NgramHash:
        return _hash(shape.ngram_size, shape.heads_per_ngram, vocab, base)

    lo, hi = 2, max(rows // heads, 2)  # padded_rows(make(lo)) <= rows (checked by the caller)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if padded_rows(make(mid), 128) <= rows else (lo, mid - 1)
    return make(lo)


def metadata(like, n_layers: int, vocab: int, quant_name: str, like_name: str,
             experts: int | None = None, ngram_rows: int | None = None) -> dict:
    c = scaled(like, n_layers, vocab, experts, ngram_rows)
    arch = FORMATS[type(c)]
    meta = {
        "general.name": f"synth-{like_name}-{n_layers}L-{quant_name}",
        "general.description": f"random weights with {like_name}'s shapes, written by `strata synth`",
        "general.file_type": QUANTS[quant_name][0],
        "general.quantization_version": 2,
    }
    meta.update(arch.gguf_metadata(c))
    if arch is not qwen3moe and n_layers < full_attention_interval(like):
        # gguf_metadata derives the interval from the layer kinds; with no full-attention layer
        # any interval > n_layers fits, so record the real one.
        meta[f"{arch.ARCH}.full_attention_interval"] = full_attention_interval(like)
    meta.update(tokenizer_metadata(vocab))
    return meta


# ----------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level BPE spells tokens in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _letters(i: int) -> str:
    """Bijective base 26: a, b, ..., z, aa, ab, ..."""
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(ord("a") + r) + s
    return s


SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer_metadata(vocab: int) -> dict:
    """A byte-level BPE vocabulary of exactly `vocab` tokens: 256 bytes, filler words, 3 specials.

    Fillers are "Ġ" + letters (a space then a word), all spelled in the byte alphabet so
    llama.cpp can detokenize every id; merges build the one-letter ones ("Ġ a" -> "Ġa").
    """
    if vocab < 256 + len(SPECIALS) + 26:
        raise BadOption(f"--vocab {vocab} is too small", "use at least 285 (256 bytes, 26 words, 3 specials)")
    space = _bytes_to_unicode()[ord(" ")]
    byte_tokens = list(_bytes_to_unicode().values())
    fillers = [space + _letters(i) for i in range(vocab - 256 - len(SPECIALS))]
    tokens = byte_tokens + fillers + list(SPECIALS)
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    merges = [f"{space} {_letters(i)}" for i in range(26)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": vocab - 3,
        "tokenizer.ggml.eos_token_id": vocab - 1,
        "tokenizer.ggml.padding_token_id": vocab - 3,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------------- writing


def _add_kv(writer: gguf.GGUFWriter, key: str, value) -> None:
    V = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, V.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, V.UINT32 if 0 <= value < 2**32 else V.INT64)
    elif isinstance(value, float):
        writer.add_key_value(key, value, V.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, V.STRING)
    elif isinstance(value, np.ndarray):  # an explicit element type (qwen4exp's uint64 hash constants)
        sub = {np.dtype(np.uint64): V.UINT64, np.dtype(np.int64): V.INT64}.get(value.dtype, V.INT32)
        writer.add_key_value(key, value.tolist(), V.ARRAY, sub_type=sub)
    else:
        sub = V.STRING if value and isinstance(value[0], str) else V.BOOL if value and isinstance(value[0], bool) \
            else V.INT32
        writer.add_key_value(key, list(value), V.ARRAY, sub_type=sub)


def _tensor_data(shape, qtype: T, kind: str, rng: np.random.Generator) -> np.ndarray:
    n = math.prod(shape)
    if qtype == T.F32:
        if kind == "norm":  # RMSNorm weights near 1 (qwen3next stores its zero-centred ones as 1 + w)
            return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).reshape(shape)
        if kind == "ssm_a":  # -exp(A_log): negative, so the DeltaNet state decays
            return -rng.uniform(0.5, 8.0, n).astype(np.float32).reshape(shape)
        if kind in ("ssm_dt", "conv"):
            return (0.1 * rng.standard_normal(n, dtype=np.float32)).reshape(shape)
        return (WEIGHT_RMS * rng.standard_normal(n, dtype=np.float32)).reshape(shape)
    if qtype == T.F16:
        return random_f16(rng, n).reshape(shape)
    q = quant.get(qtype)
    return random_blocks(qtype, n // q.block_size, rng).reshape(*shape[:-1], shape[-1] // q.block_size * q.type_size)


class _Streamed:
    """A tensor's random data produced and written a slice of its outer dimension at a time, so a
    table of tens of GB never sits in memory (gguf's writer needs only `nbytes` and `tofile`).
    `row_scale` (F32 tensors only) scales each row: the routers' skew."""

    CHUNK_BYTES = 64 << 20

    def __init__(self, shape, qtype: T, kind: str, rng: np.random.Generator, row_scale=None):
        self.shape, self.qtype, self.kind, self.rng = tuple(shape), qtype, kind, rng
        self.nbytes = quant.row_bytes(qtype, shape[-1]) * math.prod(shape[:-1])
        self.row_scale = row_scale
        self.written = None  # the data, when rows were scaled (a router: small), for `routing_skew`

    def tofile(self, f) -> None:
        if self.row_scale is not None:
            self.written = _tensor_data(self.shape, self.qtype, self.kind, self.rng) * self.row_scale[:, None]
            self.written.astype(np.float32).tofile(f)
            return
        outer = self.shape[0]
        step = max(1, outer * self.CHUNK_BYTES // max(self.nbytes, 1))
        for start in range(0, outer, step):
            n = min(step, outer - start)
            _tensor_data((n, *self.shape[1:]), self.qtype, self.kind, self.rng).tofile(f)


def router_scales(n_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """Row norms of one router for `--router-skew S`: the expert of popularity rank r (a seeded
    permutation) has its row scaled by (1 + r) ** -S. Logits of larger rows spread wider, so they
    win the top-k more often: a Zipf-like popularity, stronger with S (0 = uniform)."""
    rank = rng.permutation(n_experts)
    return ((1.0 + rank) ** -skew).astype(np.float32)


def routing_skew(router: np.ndarray, k: int, tokens: int = 4096, seed: int = 0) -> dict:
    """Routing shares of one router over isotropic random hidden states: the hottest expert's share
    of all routings, and the share the top 30 % of experts take (uniform: 1/E and 30 %)."""
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((tokens, router.shape[1]), dtype=np.float32))
    ids = (x @ torch.from_numpy(np.ascontiguousarray(router, dtype=np.float32)).T).topk(k, dim=-1).indices
    counts = torch.bincount(ids.reshape(-1), minlength=router.shape[0]).double().sort(descending=True).values
    top = max(1, int(0.3 * router.shape[0]))
    return {"hottest_share": float(counts[0] / counts.sum()), "top30_share": float(counts[:top].sum() / counts.sum())}


def write(path, like_name: str = "qwen3-30b-a3b", layers: int = 4, quant_name: str = "Q4_K_M",
          vocab: int | None = None, seed: int = 0, log=None, experts: int | None = None,
          ngram_rows: int | None = None, router_skew: float = 0.0, sparse: bool = False,
          report: dict | None = None) -> Path:
    """Write the synthetic model; returns its path. `experts` shrinks the expert count (tests);
    `ngram_rows` sizes qwen4exp's n-gram table (default SMALL_NGRAM_ROWS); `router_skew` skews
    expert popularity (`router_scales`); `sparse` writes the header only and extends the file with
    holes (`truncate`): every weight reads as zero and no disk is used, for tests at full size.
    `report`, when given, receives the first skewed router's `routing_skew`."""
    if like_name not in LIKE:
        raise BadOption(f"unknown --like {like_name!r}", f"known: {', '.join(LIKE)}")
    if quant_name not in QUANTS:
        raise BadOption(f"unknown --quant {quant_name!r}", f"known: {', '.join(QUANTS)}")
    like = LIKE[like_name]
    if layers < 1:
        raise BadOption("--layers must be at least 1")
    vocab = vocab or like.vocab_size
    path = Path(path)
    rng = np.random.default_rng(seed)
    arch = FORMATS[type(like)].ARCH
    if experts is not None and not 1 <= experts <= like.n_experts:
        raise BadOption(f"--experts must be between 1 and {like.n_experts}")
    if ngram_rows is not None and (arch != "qwen4exp" or ngram_rows < 256):
        raise BadOption(f"--ngram-rows {ngram_rows}: only qwen4exp has an n-gram table"
                        if arch != "qwen4exp" else "--ngram-rows must be at least 1024")
    plan = tensor_plan(like, layers, vocab, quant_name, experts, ngram_rows)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata(like, layers, vocab, quant_name, like_name, experts, ngram_rows).items():
        _add_kv(writer, key, value)
    for name, shape, qtype, _ in plan:
        if qtype in (T.F32, T.F16):
            dtype = np.float32 if qtype == T.F32 else np.float16
            writer.add_tensor_info(name, shape, np.dtype(dtype), math.prod(shape) * np.dtype(dtype).itemsize)
        else:
            q = quant.get(qtype)
            byte_shape = (*shape[:-1], shape[-1] // q.block_size * q.type_size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if sparse:
        end = writer.fout[0].tell()
        align = writer.data_alignment
        pad = lambda n: -(-n // align) * align  # noqa: E731
        total = pad(end) + sum(pad(ti.nbytes) for ti in writer.tensors[0].values())
        writer.close()
        os.truncate(path, total)
        return path
    if router_skew < 0:
        raise BadOption(f"--router-skew must be >= 0, got {router_skew}", "use 0 (uniform) to about 0.5")
    skew_rng = np.random.default_rng([seed, 1])
    n_experts = experts or like.n_experts
    for name, shape, qtype, kind in plan:  # at most one slice of one tensor in memory
        scale = None
        if router_skew and kind == "router" and shape[0] == n_experts and qtype == T.F32:
            scale = router_scales(n_experts, router_skew, skew_rng)
        data = _Streamed(shape, qtype, kind, rng, scale)
        writer.write_tensor_data(data)
        if data.written is not None and report is not None and "router_skew" not in report:
            report["router_skew"] = routing_skew(data.written, min(like.n_experts_used, n_experts))
        if log:
            log(f"  {name:<28} {qtype.name:<8} {list(shape)}")
    writer.close()
    return path


def attention_free(like_name: str, layers: int) -> bool:
    """Whether a hybrid model (qwen3next, qwen4exp) cut to `layers` has no attention layer."""
    recurrent = getattr(LIKE[like_name], "recurrent", None)
    return bool(recurrent) and all(recurrent[:layers])


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="strata synth", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .gguf file to write")
    ap.add_argument("--like", default="qwen3-30b-a3b",
                    help=f"model whose shapes to copy: {', '.join(LIKE)} (all three load in llama.cpp 0.3.36 too)")
    ap.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    ap.add_argument("--quant", default="Q4_K_M", help=f"type mix: {', '.join(QUANTS)} (default Q4_K_M)")
    ap.add_argument("--vocab", type=int, default=None, help="shrink the vocabulary to save disk (default: the model's)")
    ap.add_argument("--experts", type=int, default=None,
                    help="fewer experts per layer than the model has (small test files; default: the model's)")
    ap.add_argument("--ngram-rows", type=int, default=None,
                    help=f"qwen4exp: rows of the n-gram table (default {SMALL_NGRAM_ROWS}; the real model's "
                         f"{LIKE['qwen4exp'].ple_rows:,} rows of 160 values are 28.8 GB at Q4_0)")
    ap.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                    help="Zipf-like expert popularity: router rows scaled by (1 + rank) ** -S over a seeded "
                         "ranking (0 = uniform, the default; 0.2 gives the top 30%% of experts ~70%% of routings)")
    ap.add_argument("--sparse", action="store_true",
                    help="write the header only and extend the file with holes: full size, no disk used, "
                         "every weight zero (for tests of size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true", help="list the tensors as they are written")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    report: dict = {}
    path = write(args.out, args.like, args.layers, args.quant, args.vocab, args.seed,
                 log=print if args.verbose else None, experts=args.experts, ngram_rows=args.ngram_rows,
                 router_skew=args.router_skew, sparse=args.sparse, report=report)
    size = path.stat().st_size
    print(f"wrote {path}: {args.like} shapes, {args.layers} layers, {args.quant}, "
          f"{size / 2**30:.2f} GiB{' (sparse: holes, no data)' if args.sparse else ''} "
          f"in {time.perf_counter() - t0:.1f} s")
    if "router_skew" in report:
        r = report["router_skew"]
        print(f"  router skew {args.router_skew}: hottest expert takes {r['hottest_share']:.2%} of routings "
              f"(uniform {1 / (args.experts or LIKE[args.like].n_experts):.2%}), the top 30% of experts take "
              f"{r['top30_share']:.1%} (layer 0's router over 4096 random hidden states)")
    if attention_free(args.like, args.layers):
        print(f"  note: {args.layers} layers hold no attention layer (every 4th is one): Strata runs the file; "
              f"llama.cpp 0.3.36 aborts on it (GGML_ASSERT(buffer): its KV cache has no layer). "
              f"Use --layers 4 or more to compare with llama.cpp")
    return 0
