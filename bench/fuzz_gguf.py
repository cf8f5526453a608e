"""Fuzz `strata run` with mutated GGUF files; every case must end in a clean one-line error or a run.

    python bench/fuzz_gguf.py --cases 10000 --seed 0 --jobs 2

Seeds are tiny complete models (llama with experts, qwen3moe, qwen3next, qwen4exp), each with a
byte-level tokenizer.
Each case applies one to three seeded mutations: truncation, flipped bytes, huge u64 fields in the
header, huge counts and dims, bad offsets, wrong or unknown value and tensor types, missing,
ill-typed or out-of-range metadata, deeply nested arrays, bad alignment, and tokenizer arrays of
mismatched lengths. The case runs `strata run --model CASE --prompt hi --max-tokens 3` in a child
process with an address-space cap (RLIMIT_AS) and a timeout, and is classified:

    clean      exit 2 with one line on stderr (a StrataError)
    ran        exit 0
    traceback  any other exception (the child prints it), or exit 2 with more than one line
    hang       still running at the timeout (killed)
    crash      killed by a signal
    memory     MemoryError or a failed allocation under the cap

Python and torch take seconds to start, so children are forked from this process after it has
imported everything a case needs (a fork server): a case costs its own work only. The parent
never runs a torch op, so no OpenMP pool exists when it forks.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import resource
import signal
import struct
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

V = gguf.GGUFValueType
_FMT = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
        V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d"}
OUTCOMES = ("clean", "ran", "traceback", "hang", "crash", "memory")
EXIT_TRACEBACK, EXIT_MEMORY = 101, 102
HUGE = [0, 1, 2, 3, 7, 65, 255, 2**16 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63,
        2**64 - 1]


# -- a GGUF document that can hold anything, valid or not ------------------------------------------

@dataclass
class KV:
    key: str
    type: int
    value: object  # scalar; str; (item_type, [items]) for arrays; bytes for an unknown type
    count: int | None = None  # an array's declared count, when it lies


@dataclass(frozen=True)
class Nested:
    depth: int  # arrays of one array, `depth` deep, ending in one int32


@dataclass
class TensorEntry:
    name: str
    dims: list[int]  # innermost first, as stored
    type: int
    offset: int
    n_dims: int | None = None  # a declared n_dims that lies


@dataclass
class Doc:
    kvs: list[KV]
    tensors: list[TensorEntry]
    data: bytes
    alignment: int = 32
    n_tensors: int | None = None
    n_kv: int | None = None
    version: int = 3

    def copy(self) -> "Doc":
        return Doc([KV(k.key, k.type, k.value, k.count) for k in self.kvs],
                   [TensorEntry(t.name, list(t.dims), t.type, t.offset, t.n_dims) for t in self.tensors],
                   self.data, self.alignment, self.n_tensors, self.n_kv, self.version)


def _string(s) -> bytes:
    raw = s if isinstance(s, bytes) else s.encode("utf-8", errors="surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _value(kind: int, value, count: int | None = None) -> bytes:
    if kind == V.STRING:
        return _string(value)
    if kind == V.ARRAY and isinstance(value, Nested):  # iteratively: the depth is the point
        return struct.pack("<IQ", V.ARRAY, 1) * (value.depth - 1) + struct.pack("<IQi", V.INT32, 1, 1)
    if kind == V.ARRAY:
        item, items = value
        out = [struct.pack("<IQ", item, len(items) if count is None else count)]
        out += [_value(item, v) for v in items]
        return b"".join(out)
    if kind in _FMT:
        return struct.pack(_FMT[kind], value)
    return value if isinstance(value, bytes) else b""  # an unknown type: whatever bytes follow


def encode(doc: Doc) -> bytes:
    out = [b"GGUF", struct.pack("<I", doc.version),
           struct.pack("<QQ", len(doc.tensors) if doc.n_tensors is None else doc.n_tensors,
                       len(doc.kvs) if doc.n_kv is None else doc.n_kv)]
    for kv in doc.kvs:
        out += [_string(kv.key), struct.pack("<I", kv.type), _value(kv.type, kv.value, kv.count)]
    for t in doc.tensors:
        out += [_string(t.name), struct.pack("<I", len(t.dims) if t.n_dims is None else t.n_dims)]
        out += [struct.pack("<Q", d) for d in t.dims]
        out += [struct.pack("<IQ", t.type, t.offset)]
    head = b"".join(out)
    align = doc.alignment if doc.alignment > 0 else 32
    return head + b"\0" * (-len(head) % align) + doc.data


def read_doc(path: Path) -> Doc:
    """A seed file as a `Doc` (gguf-py reads it: the fuzzer must not trust the code it tests)."""
    r = gguf.GGUFReader(str(path))
    kvs = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        kind = int(f.types[0])
        if kind == V.ARRAY:
            item = int(f.types[1]) if len(f.types) > 1 else int(V.INT32)
            kvs.append(KV(name, kind, (item, list(f.contents()))))
        else:
            kvs.append(KV(name, kind, f.contents()))
    start = min(int(t.data_offset) for t in r.tensors)
    data = bytes(r.data[start:])
    tensors = [TensorEntry(t.name, [int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset) - start)
               for t in r.tensors]
    alignment = int(r.fields["general.alignment"].contents()) if "general.alignment" in r.fields else 32
    return Doc(kvs, tensors, data, alignment)


# -- seeds -------------------------------------------------------------------------------------------

def write_seeds(out: Path) -> list[Path]:
    """Tiny complete models with tokenizers: llama with 4 experts, qwen3moe, qwen3next, qwen4exp;
    F32, random norms."""
    import torch

    from strata.gguf.writer import write_gguf
    from strata.formats import llama, qwen3moe
    from strata.formats.hparams import RopeConfig
    from strata.synth import tokenizer_metadata

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    vocab, hidden, heads, kv_heads, head_dim, ffn, experts = 300, 32, 4, 2, 8, 16, 4

    def r(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def layer(p, qk_norm):
        t = {f"{p}.attn_norm.weight": 1 + r(hidden), f"{p}.ffn_norm.weight": 1 + r(hidden),
             f"{p}.attn_q.weight": r(heads * head_dim, hidden), f"{p}.attn_k.weight": r(kv_heads * head_dim, hidden),
             f"{p}.attn_v.weight": r(kv_heads * head_dim, hidden), f"{p}.attn_output.weight": r(hidden, heads * head_dim),
             f"{p}.ffn_gate_inp.weight": r(experts, hidden), f"{p}.ffn_gate_exps.weight": r(experts, ffn, hidden),
             f"{p}.ffn_up_exps.weight": r(experts, ffn, hidden), f"{p}.ffn_down_exps.weight": r(experts, hidden, ffn)}
        if qk_norm:
            t.update({f"{p}.attn_q_norm.weight": 1 + r(head_dim), f"{p}.attn_k_norm.weight": 1 + r(head_dim)})
        return t

    tok = tokenizer_metadata(vocab)
    paths = []
    common = dict(vocab_size=vocab, hidden_size=hidden, n_layers=2, n_heads=heads, n_kv_heads=kv_heads,
                  head_dim=head_dim, rms_eps=1e-5, context_length=64, n_experts=experts, n_experts_used=2)
    configs = [(llama, llama.Config(**common, ffn_size=ffn, rope=RopeConfig(dim=8, interleaved=True)), False),
               (qwen3moe, qwen3moe.Config(**common, ffn_size=0, expert_ffn_size=ffn, norm_topk_prob=True,
                                          rope=RopeConfig(dim=8)), True)]
    for module, c, qk_norm in configs:
        tensors = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": 1 + r(hidden),
                   "output.weight": r(vocab, hidden)}
        for i in range(c.n_layers):
            tensors.update(layer(f"blk.{i}", qk_norm))
        path = out / f"seed-{module.ARCH}.gguf"
        meta = {**module.gguf_metadata(c), **tok}
        write_gguf(path, module.ARCH, meta, [(n, t, gguf.GGMLQuantizationType.F32) for n, t in tensors.items()])
        paths.append(path)
    return paths + _hybrid_seeds(out, vocab, hidden, heads, kv_heads, head_dim, ffn, experts)


def _hybrid_seeds(out: Path, vocab, hidden, heads, kv_heads, head_dim, ffn, experts) -> list[Path]:
    """qwen3next and qwen4exp (a Gated DeltaNet layer, then an attention layer; qwen4exp with
    hyper-connections, QSA and a small n-gram table): `strata synth`'s layout and metadata for a
    tiny config, every tensor F32."""
    import numpy as np
    import torch

    from strata import synth
    from strata.formats import qwen3next, qwen4exp
    from strata.formats.hparams import RopeConfig
    from strata.gguf.writer import write_gguf

    common = dict(vocab_size=vocab, hidden_size=hidden, n_layers=2, n_heads=heads, n_kv_heads=kv_heads,
                  head_dim=head_dim, expert_ffn_size=ffn, shared_ffn_size=ffn, n_experts=experts,
                  n_experts_used=2, norm_topk_prob=True, rms_eps=1e-6, rope=RopeConfig(dim=4),
                  context_length=64, recurrent=(True, False), conv_kernel=4, linear_k_heads=2,
                  linear_v_heads=4, linear_k_dim=8, linear_v_dim=8)
    configs = [qwen3next.Config(**common, ffn_size=0),
               qwen4exp.Config(**common, rope_sections=(2, 0, 0, 0), gate_act="sigmoid", hc_count=2, hc_rank=8,
                               indexer_heads=2, indexer_dim=8, indexer_budget=16, compress_ratios=(0, 4),
                               ple_layers=(1,), ple_row_dim=4, ple_hash=synth._hash(3, 2, vocab, 2))]
    rng = np.random.default_rng(0)
    paths = []
    for c in configs:
        arch = synth.FORMATS[type(c)].ARCH
        rows = 1024 if c.__class__ is qwen4exp.Config else None
        meta = {**synth.metadata(c, c.n_layers, vocab, "F16", f"fuzz-{arch}", None, rows), "general.file_type": 0}
        tensors = [(name, torch.from_numpy(synth._tensor_data(shape, gguf.GGMLQuantizationType.F32, kind, rng)),
                    gguf.GGMLQuantizationType.F32)
                   for name, shape, _, kind in synth.tensor_plan(c, c.n_layers, vocab, "F16", None, rows)]
        path = out / f"seed-{arch}.gguf"
        write_gguf(path, arch, meta, tensors)
        paths.append(path)
    return paths


# -- mutations --------------------------------------------------------------------------------------

def _bad_scalar(rng: random.Random) -> tuple[int, object]:
    return rng.choice([
        (V.UINT32, rng.choice([h for h in HUGE if h < 2**32])), (V.UINT64, rng.choice(HUGE)),
        (V.INT32, rng.choice([-1, -(2**31), 0])), (V.INT64, rng.choice([-1, -(2**63)])),
        (V.FLOAT32, rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 0.5, 1e30, 65.5])),
        (V.FLOAT64, rng.choice([math.nan, math.inf, 1e300, -0.0, 2.0**64])), (V.BOOL, rng.random() < 0.5),
        (V.STRING, rng.choice(["", "abc", "\udcff", "x" * 1000])), (V.ARRAY, (V.UINT32, [])),
        (V.ARRAY, (V.FLOAT32, [math.nan, 1.0])), (V.ARRAY, (V.STRING, ["a", "b"])),
        (V.UINT8, 0), (V.INT16, -5),
    ])


def _pick_kv(doc: Doc, rng: random.Random) -> KV | None:
    if not doc.kvs:
        return None
    arch = [k for k in doc.kvs if not k.key.startswith(("tokenizer.", "general."))]
    return rng.choice(arch if arch and rng.random() < 0.7 else doc.kvs)


def m_value(doc: Doc, rng: random.Random) -> str:
    kv = _pick_kv(doc, rng)
    if kv is None:
        return "value:none"
    if isinstance(kv.value, tuple) and kv.value[1] and rng.random() < 0.5:  # one item of an array
        item, items = kv.value
        items = list(items)
        i = rng.randrange(len(items))
        if item in _FMT and item not in (V.FLOAT32, V.FLOAT64, V.BOOL):
            bits = struct.calcsize(_FMT[item]) * 8
            lo = -(2 ** (bits - 1)) if _FMT[item].islower() and _FMT[item][-1] != "?" else 0
            items[i] = rng.choice([lo, 0, 2 ** (bits - 1 if lo else bits) - 1])
        elif item in (V.FLOAT32, V.FLOAT64):
            items[i] = rng.choice([math.nan, math.inf, -1.0])
        elif item == V.STRING:
            items[i] = rng.choice(["", "\udcff", "x" * 300])
        kv.value = (item, items)
        return f"value:item:{kv.key}"
    kv.type, kv.value = _bad_scalar(rng)
    return f"value:{kv.key}"


def m_missing(doc: Doc, rng: random.Random) -> str:
    kv = _pick_kv(doc, rng)
    if kv is None:
        return "missing:none"
    doc.kvs.remove(kv)
    return f"missing:{kv.key}"


def m_type_id(doc: Doc, rng: random.Random) -> str:
    kv = _pick_kv(doc, rng)
    if kv is None:
        return "type:none"
    if isinstance(kv.value, tuple) and rng.random() < 0.5:
        kv.value = (rng.choice([13, 14, 100, 2**32 - 1]), kv.value[1][:0])
        kv.count = rng.choice([0, 1, 5])
        return f"type:item:{kv.key}"
    kv.type = rng.choice([13, 14, 255, 2**31, 2**32 - 1])
    kv.value = rng.randbytes(rng.choice([0, 4, 8]))
    return f"type:{kv.key}"


def m_count(doc: Doc, rng: random.Random) -> str:
    arrays = [k for k in doc.kvs if k.type == V.ARRAY and isinstance(k.value, tuple)]
    what = rng.choice(["array", "n_kv", "n_tensors"] if arrays else ["n_kv", "n_tensors"])
    if what == "array":
        kv = rng.choice(arrays)
        kv.count = rng.choice(HUGE + [len(kv.value[1]) + 1, max(len(kv.value[1]) - 1, 0)])
        return f"count:array:{kv.key}"
    setattr(doc, what, rng.choice(HUGE))
    return f"count:{what}"


def m_nested(doc: Doc, rng: random.Random) -> str:
    depth = rng.choice([2, 3, 64, 1000, 5000, 20000])
    value = Nested(depth)
    kv = _pick_kv(doc, rng) if rng.random() < 0.5 else None
    if kv is None:
        doc.kvs.append(KV("fuzz.nested", V.ARRAY, value))
        return f"nested:{depth}"
    kv.type, kv.value = V.ARRAY, value
    return f"nested:{depth}:{kv.key}"


def m_dims(doc: Doc, rng: random.Random) -> str:
    t = rng.choice(doc.tensors)
    kind = rng.choice(["n_dims0", "n_dims_huge", "n_dims5", "dim", "overflow", "zero", "swap"])
    if kind == "n_dims0":
        t.dims = []
    elif kind == "n_dims_huge":
        t.n_dims = rng.choice([5, 2**16, 2**32 - 1])
    elif kind == "n_dims5":
        t.dims = t.dims + [1] * rng.choice([1, 3, 6])
    elif kind == "dim":
        t.dims[rng.randrange(len(t.dims))] = rng.choice(HUGE[1:])
    elif kind == "overflow":
        t.dims = [2**32, 2**32] + t.dims[2:]
    elif kind == "zero":
        t.dims[rng.randrange(len(t.dims))] = 0
    else:
        t.dims = list(reversed(t.dims))
    return f"dims:{kind}:{t.name}"


def m_tensor_type(doc: Doc, rng: random.Random) -> str:
    t = rng.choice(doc.tensors)
    t.type = rng.choice([1, 2, 8, 12, 14, 30, 39, 40, 41, 99, 2**32 - 1])
    return f"ttype:{t.type}:{t.name}"


def m_offset(doc: Doc, rng: random.Random) -> str:
    t = rng.choice(doc.tensors)
    t.offset = rng.choice([1, 3, t.offset + 1, len(doc.data), len(doc.data) - 4, 2**40, 2**63, 2**64 - 1, 0])
    return f"offset:{t.name}"


def m_names(doc: Doc, rng: random.Random) -> str:
    kind = rng.choice(["drop", "dup", "rename", "extra_layer"])
    t = rng.choice(doc.tensors)
    if kind == "drop":
        doc.tensors.remove(t)
    elif kind == "dup":
        doc.tensors.append(TensorEntry(t.name, list(t.dims), t.type, t.offset))
    elif kind == "rename":
        t.name = rng.choice(["", "blk.99.attn_q.weight", "x" * 300, t.name + ".extra", "blk.-1.ffn_norm.weight"])
    else:
        doc.tensors.append(TensorEntry(t.name.replace("blk.0.", "blk.7.").replace("blk.1.", "blk.7."),
                                       list(t.dims), t.type, t.offset))
    return f"names:{kind}"


def m_alignment(doc: Doc, rng: random.Random) -> str:
    value = rng.choice([(V.UINT32, 0), (V.UINT32, 1), (V.UINT32, 3), (V.UINT32, 2**31), (V.UINT32, 2**32 - 1),
                        (V.STRING, "32"), (V.FLOAT32, math.nan), (V.INT32, -32)])
    doc.kvs = [k for k in doc.kvs if k.key != "general.alignment"] + [KV("general.alignment", *value)]
    return f"alignment:{value[1]!r}"


def m_tokenizer(doc: Doc, rng: random.Random) -> str:
    kvs = {k.key: k for k in doc.kvs}
    kind = rng.choice(["types_short", "types_long", "merges", "eos", "model", "tokens_empty", "dup_tokens",
                       "scores"])
    if kind in ("types_short", "types_long") and "tokenizer.ggml.token_type" in kvs:
        kv = kvs["tokenizer.ggml.token_type"]
        item, items = kv.value
        kv.value = (item, items[:-rng.choice([1, 5, len(items)])] if kind == "types_short" else items + [1] * 7)
    elif kind == "merges" and "tokenizer.ggml.merges" in kvs:
        kvs["tokenizer.ggml.merges"].value = (V.STRING, rng.choice([["a"], ["x y z"], ["\udcff \udcfe"], [" "]]))
    elif kind == "eos" and "tokenizer.ggml.eos_token_id" in kvs:
        kvs["tokenizer.ggml.eos_token_id"].type, kvs["tokenizer.ggml.eos_token_id"].value = \
            V.UINT32, rng.choice([2**31, 2**32 - 1, 300, 100000])
    elif kind == "model" and "tokenizer.ggml.model" in kvs:
        kvs["tokenizer.ggml.model"].value = rng.choice(["llama", "bert", "t5", "rwkv", "nope", ""])
    elif kind == "tokens_empty" and "tokenizer.ggml.tokens" in kvs:
        kvs["tokenizer.ggml.tokens"].value = (V.STRING, [])
    elif kind == "dup_tokens" and "tokenizer.ggml.tokens" in kvs:
        item, items = kvs["tokenizer.ggml.tokens"].value
        kvs["tokenizer.ggml.tokens"].value = (item, [items[0]] * len(items))
    else:
        doc.kvs.append(KV("tokenizer.ggml.scores", V.ARRAY, (V.FLOAT32, [math.nan] * 3)))
    return f"tokenizer:{kind}"


STRUCTURAL = [m_value, m_value, m_value, m_missing, m_type_id, m_count, m_nested, m_dims, m_dims, m_tensor_type,
              m_offset, m_names, m_alignment, m_tokenizer]


def b_truncate(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    cut = rng.choice([rng.randrange(len(raw)), rng.randrange(min(len(raw), 4096)), len(raw) - rng.randrange(1, 64)])
    return raw[:max(cut, 0)], "truncate"


def b_flip(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    buf = bytearray(raw)
    head = min(len(buf), 8192)
    for _ in range(rng.choice([1, 2, 4, 16])):
        i = rng.randrange(head) if rng.random() < 0.8 else rng.randrange(len(buf))
        buf[i] ^= 1 << rng.randrange(8)
    return bytes(buf), "flip"


def b_u64(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    buf = bytearray(raw)
    i = rng.randrange(8, max(min(len(buf), 8192) - 8, 9))
    buf[i:i + 8] = struct.pack("<Q", rng.choice(HUGE))
    return bytes(buf), "u64"


BYTEWISE = [b_truncate, b_flip, b_u64]


def mutate(seed_doc: Doc, rng: random.Random) -> tuple[bytes, list[str]]:
    doc, what = seed_doc.copy(), []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        what.append(rng.choice(STRUCTURAL)(doc, rng))
    raw = encode(doc)
    if rng.random() < 0.3:
        raw, kind = rng.choice(BYTEWISE)(raw, rng)
        what.append(kind)
    return raw, what


# -- running cases (fork server) ----------------------------------------------------------------------

def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _child(path: Path, log: Path, mem_bytes: int, timeout: float) -> None:
    """In the forked child: cap memory, run the CLI, exit with what happened (never returns)."""
    code = EXIT_TRACEBACK
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1, closefd=False)  # also when sys.std* were replaced
        resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + mem_bytes, resource.RLIM_INFINITY))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.alarm(int(timeout) + 5)  # the parent kills it first; this is a backstop
        import torch

        torch.set_num_threads(1)
        from strata.cli import main

        code = main(["run", "--model", str(path), "--prompt", "hi", "--max-tokens", "3"])
    except MemoryError:
        code = EXIT_MEMORY
    except BaseException as e:  # noqa: BLE001 - everything here is a finding, PanicException included
        if isinstance(e, SystemExit) and isinstance(e.code, int):
            code = e.code
        elif isinstance(e, RuntimeError) and "allocat" in str(e):
            code = EXIT_MEMORY
        else:
            traceback.print_exc()
            code = EXIT_TRACEBACK
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else EXIT_TRACEBACK)


@dataclass
class Result:
    case: int
    outcome: str
    mutations: list[str]
    detail: str = ""
    seconds: float = 0.0


def _classify(status: int | None, log: Path) -> tuple[str, str]:
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("loaded ")]
    if status is None:
        return "hang", ""
    if os.WIFSIGNALED(status):
        return "crash", signal.Signals(os.WTERMSIG(status)).name
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "ran", ""
    if code == EXIT_MEMORY:
        return "memory", lines[-1] if lines else ""
    if code == 2 and "Traceback" not in text and text.endswith("\n") and len(
            [line for line in lines if "error:" in line]) == 1 and lines[-1].startswith("strata run: error:"):
        return "clean", lines[-1]
    tb = [line for line in lines if line.startswith("  File ")]
    return "traceback", ((tb[-1].strip() + " | ") if tb else "") + (lines[-1] if lines else f"exit {code}")


def run_cases(seeds: list[Path], cases: int, seed: int, jobs: int, timeout: float, mem_bytes: int,
              work: Path, start: int = 0, progress=None, mutations: bool = True) -> list[Result]:
    """Cases start..start+cases-1, `jobs` at a time; `mutations=False` runs the seeds as they are."""
    import strata.cli  # noqa: F401 - imported before forking, so children start warm
    import strata.formats.tokenizer  # noqa: F401
    import strata.loader  # noqa: F401
    import strata.runtime.run_cli  # noqa: F401
    import strata.models.registry  # noqa: F401 - every architecture's model code
    docs = [read_doc(p) for p in seeds]
    work.mkdir(parents=True, exist_ok=True)
    running: dict[int, tuple[int, float, Path, Path, list[str]]] = {}
    results: list[Result] = []
    todo = iter(range(start, start + cases))
    exhausted = False
    while running or not exhausted:
        while not exhausted and len(running) < jobs:
            i = next(todo, None)
            if i is None:
                exhausted = True
                break
            rng = random.Random(seed * 1_000_003 + i)
            raw, what = mutate(docs[i % len(docs)], rng) if mutations else (encode(docs[i % len(docs)]), [])
            path, log = work / f"case-{i % (4 * jobs)}.gguf", work / f"case-{i % (4 * jobs)}.log"
            path.write_bytes(raw)
            pid = os.fork()
            if pid == 0:
                _child(path, log, mem_bytes, timeout)
            running[pid] = (i, time.monotonic(), path, log, what)
        time.sleep(0.002)
        for pid, (i, t0, path, log, what) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if not done and time.monotonic() - t0 < timeout:
                continue
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = None
            outcome, detail = _classify(status, log)
            results.append(Result(i, outcome, what, detail, time.monotonic() - t0))
            del running[pid]
            if progress:
                progress(results[-1])
    return sorted(results, key=lambda r: r.case)


def table(results: list[Result]) -> str:
    counts = collections.Counter(r.outcome for r in results)
    n = max(len(results), 1)
    rows = [f"{'outcome':<10} {'cases':>7} {'share':>7}"]
    rows += [f"{o:<10} {counts[o]:>7} {100 * counts[o] / n:>6.1f}%" for o in OUTCOMES]
    rows.append(f"{'total':<10} {len(results):>7}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first case number (to rerun one: --start N --cases 1)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a case counts as a hang")
    ap.add_argument("--mem-gb", type=float, default=2.0, help="address space a case may add (RLIMIT_AS)")
    ap.add_argument("--work", default="/tmp/strata-fuzz", help="scratch directory for seeds and cases")
    ap.add_argument("--json", default=None, help="write every case's outcome here")
    ap.add_argument("--keep", action="store_true", help="save each failing case's file under WORK/failed")
    args = ap.parse_args(argv)
    work = Path(args.work)
    seeds = write_seeds(work / "seeds")
    t0 = time.time()
    failed_dir = work / "failed"

    def progress(r: Result):
        if r.outcome not in ("clean", "ran"):
            print(f"case {r.case}: {r.outcome}: {' + '.join(r.mutations)}: {r.detail}", file=sys.stderr)
            if args.keep:
                failed_dir.mkdir(exist_ok=True)
                src = work / "cases" / f"case-{r.case % (4 * args.jobs)}.gguf"
                if src.exists():
                    (failed_dir / f"case-{r.case}.gguf").write_bytes(src.read_bytes())

    results = run_cases(seeds, args.cases, args.seed, args.jobs, args.timeout, int(args.mem_gb * 2**30),
                        work / "cases", args.start, progress)
    wall = time.time() - t0
    print(table(results))
    causes = collections.Counter(r.detail for r in results if r.outcome not in ("clean", "ran"))
    if causes:
        print(f"\n{len(causes)} distinct failure causes:")
        for cause, n in causes.most_common():
            print(f"{n:>6}  {cause}")
    print(f"\n{len(results)} cases (seed {args.seed}, {len(seeds)} seed files) in {wall:.0f} s, "
          f"{args.jobs} at once, timeout {args.timeout:g} s, cap {args.mem_gb:g} GB")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=0))
    return 0 if not causes else 1


if __name__ == "__main__":
    sys.exit(main())
