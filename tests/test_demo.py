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
    meta = GGUFFile(DEMO).metadata
    assert meta["general.architecture"] == "qwen3moe"
    assert meta["qwen3moe.block_count"] >= 8
    assert meta["qwen3moe.expert_count"] >= 32
    assert 2 <= meta["qwen3moe.expert_used_count"] < meta["qwen3moe.expert_count"]
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


def test_trainable_model_matches_the_engine(tmp_path):
    """The trainer's module and strata's qwen3moe compute the same logits from the same weights."""
    import gguf

    from strata.demo.trainable import TrainableMoE
    from strata.gguf.writer import write_gguf
    from strata.models.qwen3moe import Config, gguf_metadata
    from strata.models.rope import RopeConfig

    c = Config(vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_size=0,
               expert_ffn_size=16, n_experts=8, n_experts_used=2, norm_topk_prob=True, rms_eps=1e-6,
               rope=RopeConfig(dim=8, theta=10000.0), context_length=64)
    model = TrainableMoE(c)
    model.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():  # make norms and the router matter
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * (0.3 if p.dim() == 1 else 0.2))
    path = write_gguf(tmp_path / "tiny.gguf", "qwen3moe", gguf_metadata(c),
                      [(n, t, gguf.GGMLQuantizationType.F32) for n, t in model.gguf_tensors()])
    ids = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    got = strata.load(path).logits(ids.tolist())
    with torch.no_grad():
        want, routing = model(ids[None], return_routing=True)
    assert (got - want[0]).abs().max().item() < 1e-4
    assert all(chosen.unique().numel() > 2 for _, chosen in routing)
