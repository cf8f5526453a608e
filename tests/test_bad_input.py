"""Bad input gives one line naming the problem (and the fix), exit code 2, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import strata
from strata.cli import main
from strata.errors import StrataError
from tiny import llama_config, llama_tensors, write_tiny_llama


def run_cli(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.endswith("\n"), err
    err = err.strip()
    lines = [line for line in err.splitlines() if not line.startswith("loaded ")]  # the load summary
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("good") / "tiny.gguf")


def test_the_tiny_model_is_fine(good, capsys):
    assert main(["run", "--model", str(good), "--prompt", "hi", "--max-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 3


def test_truncated_gguf(good, tmp_path, capsys):
    data = good.read_bytes()
    for cut in (100, len(data) - 50):  # inside the header, inside the tensor data
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert "truncated" in run_cli(["inspect", str(bad)], capsys)


def test_bad_magic(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    assert "not a GGUF file" in run_cli(["run", "--model", str(bad), "--prompt", "x"], capsys)


def test_missing_file_names_the_path(tmp_path, capsys):
    assert "no such file" in run_cli(["inspect", str(tmp_path / "nope.gguf")], capsys)


def test_unknown_architecture(tmp_path, capsys):
    path = write_tiny_llama(tmp_path / "m.gguf", arch="mamba9")
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    assert "mamba9" in err and "supported" in err


def test_missing_metadata_key_is_named(tmp_path, capsys):
    path = write_tiny_llama(tmp_path / "m.gguf", drop_keys=("llama.block_count",))
    assert "llama.block_count" in run_cli(["inspect", str(path)], capsys)


def test_unsupported_quant_type(tmp_path, capsys):
    c = llama_config()
    tensors = llama_tensors(c)
    path = tmp_path / "q81.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    from strata.formats import llama

    for k, v in llama.gguf_metadata(c).items():
        w.add_key_value(k, v, gguf.GGUFValueType.FLOAT32 if isinstance(v, float) else gguf.GGUFValueType.UINT32)
    for name, t in tensors.items():
        if name == "blk.0.attn_q.weight":  # Q8_1: an activation type, never a weight type
            raw = np.zeros((t.shape[0], t.shape[1] // 32 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1]), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(name, t.numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    assert "Q8_1" in err


def test_wrong_tensor_shape(tmp_path, capsys):
    c = llama_config()
    tensors = llama_tensors(c)
    tensors["blk.1.attn_k.weight"] = torch.zeros(12, c.hidden_size)
    path = write_tiny_llama(tmp_path / "m.gguf", tensors=tensors)
    err = run_cli(["run", "--model", str(path), "--prompt", "x"], capsys)
    assert "blk.1.attn_k.weight" in err and "(12, 32)" in err


def test_missing_safetensors_shard(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 258, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48}))
    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    err = run_cli(["run", "--model", str(tmp_path), "--prompt", "x"], capsys)
    assert "model-00002-of-00002.safetensors" in err and "missing" in err


def test_prompt_longer_than_context(good, capsys):
    err = run_cli(["run", "--model", str(good), "--prompt", "x" * 100], capsys)
    assert "100 tokens" in err and "--ctx-size" in err
    with pytest.raises(StrataError, match="context"):
        strata.load(good).generate(list(range(65)), 4)


def test_unknown_option_and_bad_sampling(good):
    with pytest.raises(StrataError, match="unknown option 'bogus'"):
        strata.load(good, bogus=1)
    with pytest.raises(StrataError, match="top_p"):
        strata.load(good).generate([1, 2, 3], 2, temperature=1.0, top_p=0.0)


@pytest.mark.parametrize("flag, value", [("--temperature", "1e-300"), ("--repeat-penalty", "1e-300"),
                                         ("--seed", str(2**64)), ("--seed", str(10**30)), ("--temperature", "nan"),
                                         ("--top-p", "inf")])
def test_bad_sampling_values_on_the_cli(good, capsys, flag, value):
    err = run_cli(["run", "--model", str(good), "--prompt", "x", flag, value], capsys)
    assert value in err
    assert flag.lstrip("-").replace("-", "_").replace("repeat", "repetition") in err


def test_contradicting_activation_flags(good, capsys):
    err = run_cli(["run", "--model", str(good), "--prompt", "x", "--exact-activations", "--activations", "q8c"], capsys)
    assert "--exact-activations" in err and "q8c" in err and "disagree" in err


def test_cli_in_a_fresh_process_prints_no_traceback(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    exe = shutil.which("strata") or f"{sys.prefix}/bin/strata"
    r = subprocess.run([exe, "run", "--model", str(bad), "--prompt", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "not a GGUF file" in r.stderr


@pytest.mark.parametrize("argv", [["run", "--model"], ["run", "--model", "m.gguf", "--max-tokens", "many"],
                                  ["serve", "--bogus"], ["inspect"], ["plan", "--model", "m", "--nope"],
                                  ["cache-sim"], ["bench", "--model", "m", "--threads", "x"], ["synth"]])
def test_bad_flags_are_one_line(argv, capsys):
    err = run_cli(argv, capsys)
    assert err.startswith(f"strata {argv[0]}: error: ") and "--help" in err


def test_unknown_command_is_one_line(capsys):
    assert main(["nonsense"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n") and "nonsense" in err
