"""The bundled demo model: what `make demo` runs, and what the cache benchmarks replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import strata
from strata.demo import train
from strata.gguf.reader import GGUFFile

DEMO = Path(train.__file__).with_name("strata-demo.gguf")
needs_demo = pytest.mark.skipif(not DEMO.exists(), reason="run `make demo-model` to build the demo model")

CODE = (
    "import os\n\n\n"
    "class Config(dict):\n"
    '    """Settings read from a file."""\n\n'
    "    def __init__(self, path, *, strict=False):\n"
    "        super().__init__()\n"
    "        self.path = os.fspath(path)  # naïve: no ~ expansion\n"
    "\tif strict and not self: raise ValueError(f'{path!r} is empty: {len(self)} keys, 0x1F')\n"
)


@pytest.fixture(scope="module")
def engine():
    return strata.load(DEMO)


@needs_demo
def test_file_is_small_and_a_real_moe():
    assert DEMO.stat().st_size < 40 * 1024 * 1024
    file = GGUFFile(DEMO)
    meta, a = file.metadata, "qwen4exp"
    assert meta["general.architecture"] == a
    assert meta[f"{a}.nextn_predict_layers"] == 1 and meta[f"{a}.block_count"] >= 9  # 8 + the MTP block
    assert meta[f"{a}.expert_count"] >= 32
    assert 2 <= meta[f"{a}.expert_used_count"] <= 4
    assert meta[f"{a}.ple.layers"] == [1] and "per_layer_token_embd.weight" in file.tensors
    assert meta["tokenizer.ggml.model"] == "gpt2"


@needs_demo
def test_loads_and_generates_without_transformers():
    code = (
        "import json, sys, strata\n"
        f"e = strata.load({str(DEMO)!r})\n"
        "ids = e.tokenizer.encode('def read_config(path):\\n')\n"
        "out = e.generate(ids, max_new_tokens=4, stop_at_eos=False)\n"
        "print(json.dumps({'n': len(out), 'transformers': [m for m in sys.modules if m.split('.')[0] == 'transformers']}))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"n": 4, "transformers": []}


@needs_demo
def test_tokenizer_round_trips_code(engine):
    tok = engine.tokenizer
    for text in (CODE, train.held_out_text(4000)):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text) / 2  # a vocabulary trained on Python compresses it
    assert tok.encode("<|im_start|>user\n")[0] == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|endoftext|>") in engine.eos_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@needs_demo
def test_greedy_generation(engine):
    ids = engine.tokenizer.encode("def read_config(path):\n")
    out = engine.generate(ids, max_new_tokens=16, stop_at_eos=False)
    assert len(out) == 16
    assert all(0 <= t < engine.config.vocab_size for t in out)
    assert engine.tokenizer.decode(out, skip_special_tokens=True).strip()  # some code, not only specials


@needs_demo
def test_routing_spreads_over_experts(engine):
    ids = engine.tokenizer.encode(CODE)
    chosen: dict[str, torch.Tensor] = {}

    def tap(name, t):
        if name.startswith("ffn_moe_topk"):
            chosen[name] = t.clone()

    with torch.inference_mode():
        engine.model(torch.tensor([ids]), engine.model.new_cache(1), tap=tap)
    n_layers = engine.config.n_layers
    assert len(chosen) == n_layers
    for layer in range(n_layers):
        assert chosen[f"ffn_moe_topk-{layer}"].unique().numel() > 1


def test_held_out_files_are_fixed_and_disjoint():
    held = train.held_out_files()
    assert held and held == train.held_out_files()
    assert not set(held) & set(train.train_files())
    ids = train.held_out_tokens(lambda text: list(text.encode()), 2000)
    assert len(ids) == 2000


def test_trainable_mtp_matches_the_engine(tmp_path):
    """The trainer's MTP head, exported beside a trunk as the demo's is, computes in Strata what it
    computes in training: exactly from safetensors, within F16/Q8_0 rounding from the demo's GGUF."""
    from test_qwen4exp import eos_prompt, tiny_qwen4exp

    from strata.demo.export import write_demo_gguf, write_hf
    from strata.demo.trainable import TrainableMTP
    from strata.demo.trunk import dense_indexer

    torch.manual_seed(0)
    trunk = tiny_qwen4exp()
    mtp = TrainableMTP(trunk)
    mtp.init_from_trunk(torch.Generator().manual_seed(0))
    with torch.no_grad():  # away from the copy of the trunk it starts as
        for name, p in mtp.named_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    hf_dir = write_hf(trunk, mtp, tmp_path / "hf")
    gguf_path = write_demo_gguf(hf_dir, tmp_path / "demo.gguf", {})
    ids = eos_prompt(19)  # within the 16-token QSA budget (+ an incomplete block): dense everywhere
    with torch.no_grad(), dense_indexer():
        h = trunk.model(input_ids=torch.tensor([ids])).last_hidden_state
        want = mtp(torch.tensor([ids[1:]]), h[:, :-1])[0]
    got = {}
    for path in (hf_dir, gguf_path):
        model = strata.load(path).model
        with torch.inference_mode():
            _, hs = model(torch.tensor([ids]), model.new_cache(1), hidden=True)
            got[path] = model.mtp(torch.tensor([ids[1:]]), hs[:, :-1], model.mtp.new_cache(1))[0][0]
    assert (got[hf_dir] - want).abs().max().item() < 1e-4
    # random weights amplify F16 rounding; a wrong tensor would not keep the top tokens
    assert (got[gguf_path].argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
