"""The validation pass: each bad value a file can hold gives one line naming the key and the value.

GGUF cases are edits of a good tiny file through bench/fuzz_gguf.py's document model (it writes
anything, valid or not); safetensors cases are hand-written directories.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from test_bad_input import run_cli
from test_fuzz_gguf import fuzz
from tiny import write_tiny_llama

V = fuzz.V


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    return fuzz.read_doc(write_tiny_llama(tmp_path_factory.mktemp("good") / "tiny.gguf"))


def _set(d, key, kind, value):
    d.kvs = [k for k in d.kvs if k.key != key] + [fuzz.KV(key, kind, value)]


def _tensor(d, name):
    return next(t for t in d.tensors if t.name == name)


GGUF_CASES = {
    "alignment 0": (lambda d: _set(d, "general.alignment", V.UINT32, 0), ["general.alignment = 0"]),
    "array item type 13": (lambda d: _set(d, "llama.x", V.ARRAY, (13, [])), ["unknown value type 13"]),
    "nested 5000 deep": (lambda d: _set(d, "llama.x", V.ARRAY, fuzz.Nested(5000)), ["nested more than"]),
    "n_dims 0": (lambda d: setattr(_tensor(d, "blk.0.attn_q.weight"), "dims", []), ["blk.0.attn_q.weight", "0 dim"]),
    "element count overflow": (lambda d: setattr(_tensor(d, "blk.0.attn_q.weight"), "dims", [2**32, 2**32]),
                               ["blk.0.attn_q.weight", "int64"]),
    "head_count 0": (lambda d: _set(d, "llama.attention.head_count", V.UINT32, 0), ["llama.attention.head_count = 0"]),
    "block_count NaN": (lambda d: _set(d, "llama.block_count", V.FLOAT32, math.nan), ["llama.block_count = nan"]),
    "block_count float": (lambda d: _set(d, "llama.block_count", V.FLOAT32, 2.0), ["llama.block_count = 2.0"]),
    "expert_used_count > expert_count": (lambda d: _set(d, "llama.expert_used_count", V.UINT32, 5),
                                         ["5 experts used", "has 4"]),
    "rope dims odd": (lambda d: _set(d, "llama.rope.dimension_count", V.UINT32, 7), ["rope dimension count 7"]),
    "rope dims past the head": (lambda d: _set(d, "llama.rope.dimension_count", V.UINT32, 64),
                                ["rope dimension count 64", "head dimension 8"]),
    "rope dims 2^32-1": (lambda d: _set(d, "llama.rope.dimension_count", V.UINT32, 2**32 - 1),
                         ["llama.rope.dimension_count = 4294967295"]),
    "rope dims wider than any tensor": (lambda d: _set(d, "llama.rope.dimension_count", V.UINT32, 2**30),
                                        ["llama.rope.dimension_count = 1073741824", "wider than any tensor"]),
    "block_count 2^31-1": (lambda d: _set(d, "llama.block_count", V.UINT32, 2**31 - 1),
                           ["llama.block_count = 2147483647", "2 layers"]),
    "heads not divisible": (lambda d: _set(d, "llama.attention.head_count_kv", V.UINT32, 3),
                            ["4 attention heads", "3 KV heads"]),
    "epsilon infinite": (lambda d: _set(d, "llama.attention.layer_norm_rms_epsilon", V.FLOAT32, math.inf),
                         ["layer_norm_rms_epsilon = inf"]),
    "count as a string": (lambda d: _set(d, "llama.embedding_length", V.STRING, "32"),
                          ["llama.embedding_length = '32'", "not an integer"]),
    "tokens and token_type differ": (lambda d: _set(d, "tokenizer.ggml.token_type", V.ARRAY, (V.INT32, [1] * 5)),
                                     ["tokenizer.ggml.token_type", "258"]),
    "eos outside the vocabulary": (lambda d: _set(d, "tokenizer.ggml.eos_token_id", V.UINT32, 9999),
                                   ["tokenizer.ggml.eos_token_id = 9999"]),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_bad_gguf_metadata_is_named(doc, tmp_path, capsys, case):
    edit, wanted = GGUF_CASES[case]
    d = doc.copy()
    edit(d)
    path = tmp_path / "bad.gguf"
    path.write_bytes(fuzz.encode(d))
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    for part in wanted:
        assert part in err, err


def test_compress_ratio_that_does_not_divide_the_indexer_budget(tmp_path, capsys):
    """qwen4exp's QSA layers pick budget / ratio blocks: a ratio of 7 against a budget of 16 is named."""
    seed = next(p for p in fuzz.write_seeds(tmp_path / "seeds") if p.name == "seed-qwen4exp.gguf")
    d = fuzz.read_doc(seed)
    _set(d, "qwen4exp.attention.compress_ratios", V.ARRAY, (V.INT32, [0, 7]))
    path = tmp_path / "bad.gguf"
    path.write_bytes(fuzz.encode(d))
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    assert "compress ratio 7" in err and "16" in err, err


def test_tokenizer_panic_is_one_line(tmp_path, capsys, monkeypatch):
    """The tokenizers library panics with PanicException, a BaseException that `except Exception` misses."""
    from strata.formats.tokenizer import Tokenizer

    class PanicException(BaseException):  # what pyo3 raises: not importable, same base
        pass

    def panic(*args, **kwargs):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(Tokenizer, "from_gguf_metadata", panic)
    path = write_tiny_llama(tmp_path / "m.gguf")
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    assert "cannot build the tokenizer" in err and "PanicException" in err


# -- safetensors directories -----------------------------------------------------------------------

HF = dict(model_type="llama", vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
          num_key_value_heads=1, intermediate_size=24, max_position_embeddings=64, rms_norm_eps=1e-5)


def _hf_tensors(cfg, experts=0):
    g = torch.Generator().manual_seed(0)
    h, f, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * 8

    def r(*s):
        return torch.randn(*s, generator=g) * 0.1

    t = {"model.embed_tokens.weight": r(cfg["vocab_size"], h), "model.norm.weight": 1 + r(h),
         "lm_head.weight": r(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": 1 + r(h), f"{p}.post_attention_layernorm.weight": 1 + r(h),
                  f"{p}.self_attn.q_proj.weight": r(h, h), f"{p}.self_attn.k_proj.weight": r(kv, h),
                  f"{p}.self_attn.v_proj.weight": r(kv, h), f"{p}.self_attn.o_proj.weight": r(h, h)})
        if experts:
            t[f"{p}.block_sparse_moe.gate.weight"] = r(experts, h)
            for e in range(experts):
                q = f"{p}.block_sparse_moe.experts.{e}"
                t.update({f"{q}.w1.weight": r(f, h), f"{q}.w3.weight": r(f, h), f"{q}.w2.weight": r(h, f)})
        else:
            t.update({f"{p}.mlp.gate_proj.weight": r(f, h), f"{p}.mlp.up_proj.weight": r(f, h),
                      f"{p}.mlp.down_proj.weight": r(h, f)})
    return t


def _hf_dir(path, cfg=None, tensors=None, experts=0):
    cfg = dict(HF if cfg is None else cfg)
    if experts:
        cfg.update(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=2)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(_hf_tensors(HF, experts) if tensors is None else tensors, path / "model.safetensors")
    return path


def test_a_good_hf_directory_runs(tmp_path, capsys):
    from strata.cli import main

    assert main(["inspect", str(_hf_dir(tmp_path / "ok"))]) == 0
    assert main(["inspect", str(_hf_dir(tmp_path / "moe", experts=4))]) == 0


def _index(path, text):
    (path / "model.safetensors.index.json").write_text(text)


HF_CASES = {
    "index not JSON": (lambda p: _index(p, "{nope"), "model.safetensors.index.json"),
    "index without weight_map": (lambda p: _index(p, "{}"), "weight_map"),
    "index weight_map a list": (lambda p: _index(p, '{"weight_map": ["a"]}'), "weight_map"),
    "index a list": (lambda p: _index(p, "[1, 2]"), "weight_map"),
    "index outside the directory": (lambda p: _index(p, '{"weight_map": {"a": "../x.safetensors"}}'), "outside"),
    "truncated shard": (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:300]),
                        "model.safetensors"),
    "garbage shard": (lambda p: (p / "model.safetensors").write_bytes(b"\xff" * 64), "not a readable safetensors"),
    "config empty": (lambda p: (p / "config.json").write_text(""), "config.json: not valid JSON"),
    "config binary": (lambda p: (p / "config.json").write_bytes(b"\x00\xff\xfe" * 20), "config.json: not valid JSON"),
    "config a list": (lambda p: (p / "config.json").write_text("[1]"), "JSON list, not an object"),
    "zero heads": (lambda p: (p / "config.json").write_text(json.dumps({**HF, "num_attention_heads": 0})),
                   "num_attention_heads = 0"),
    "num_hidden_layers 1e9": (lambda p: (p / "config.json").write_text(json.dumps({**HF, "num_hidden_layers": 1e9})),
                              "num_hidden_layers = 1000000000.0"),
    "num_hidden_layers 10^9": (lambda p: (p / "config.json").write_text(json.dumps({**HF, "num_hidden_layers": 10**9})),
                               "num_hidden_layers = 1000000000 but"),
    "hidden wider than any tensor": (lambda p: (p / "config.json").write_text(json.dumps({**HF, "hidden_size": 2**30})),
                                     "hidden_size = 1073741824"),
    "eps NaN": (lambda p: (p / "config.json").write_text(json.dumps({**HF, "rms_norm_eps": float("nan")})),
                "rms_norm_eps = nan"),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_bad_hf_directory_is_named(tmp_path, capsys, case):
    edit, wanted = HF_CASES[case]
    path = _hf_dir(tmp_path / "m")
    edit(path)
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    assert wanted in err, err


def test_hf_experts_of_different_shapes(tmp_path, capsys):
    t = _hf_tensors(HF, experts=4)
    t["model.layers.1.block_sparse_moe.experts.2.w1.weight"] = torch.zeros(20, 16)
    path = _hf_dir(tmp_path / "m", tensors=t, experts=4)
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    assert "ffn_gate_exps" in err and "different shapes" in err, err


def test_hf_zero_dim_norm(tmp_path, capsys):
    t = _hf_tensors(HF)
    t["model.layers.0.input_layernorm.weight"] = torch.tensor(1.0)
    err = run_cli(["run", "--model", str(_hf_dir(tmp_path / "m", tensors=t)), "--prompt", "x"], capsys)
    assert "attn_norm" in err, err


@pytest.mark.parametrize("key,value,wanted", [
    ("ssm.group_count", 0, ["qwen3next.ssm.group_count = 0"]),
    ("ssm.time_step_rank", 0, ["qwen3next.ssm.time_step_rank = 0"]),
    ("ssm.group_count", 3, ["value heads", "3 key heads"]),
])
def test_gated_deltanet_head_counts(tmp_path, capsys, key, value, wanted):
    """A Gated DeltaNet file's key and value head counts divide each other (they were a ZeroDivisionError)."""
    seed = next(p for p in fuzz.write_seeds(tmp_path / "seeds") if p.name == "seed-qwen3next.gguf")
    d = fuzz.read_doc(seed)
    _set(d, f"qwen3next.{key}", V.UINT32, value)
    path = tmp_path / "bad.gguf"
    path.write_bytes(fuzz.encode(d))
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    for part in wanted:
        assert part in err, err
