"""Tiny GGUF files written directly (no transformers), for fast tests of loading and errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from strata.gguf.writer import write_gguf
from strata.formats import llama
from strata.formats.hparams import RopeConfig

F32 = gguf.GGMLQuantizationType.F32


def byte_tokenizer_metadata() -> dict:
    """A byte-level BPE vocabulary of 256 byte tokens, one merge and an EOS, with no merges."""
    from strata.formats.tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["\u0120t", "<|endoftext|>"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 257 + [3],
            "tokenizer.ggml.merges": ["\u0120 t"], "tokenizer.ggml.eos_token_id": 257,
            "tokenizer.ggml.bos_token_id": 257, "tokenizer.ggml.add_bos_token": False}


def llama_config(**overrides) -> llama.Config:
    fields = dict(vocab_size=258, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  ffn_size=48, rms_eps=1e-5, rope=RopeConfig(dim=8, interleaved=True), context_length=64,
                  n_experts=4, n_experts_used=2)
    fields.update(overrides)
    return llama.Config(**fields)


def llama_tensors(c: llama.Config, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    t = {"token_embd.weight": r(c.vocab_size, c.hidden_size), "output_norm.weight": 1 + r(c.hidden_size)}
    for i in range(c.n_layers):
        p = f"blk.{i}"
        t.update({f"{p}.attn_norm.weight": 1 + r(c.hidden_size), f"{p}.ffn_norm.weight": 1 + r(c.hidden_size),
                  f"{p}.attn_q.weight": r(c.n_heads * c.head_dim, c.hidden_size),
                  f"{p}.attn_k.weight": r(c.n_kv_heads * c.head_dim, c.hidden_size),
                  f"{p}.attn_v.weight": r(c.n_kv_heads * c.head_dim, c.hidden_size),
                  f"{p}.attn_output.weight": r(c.hidden_size, c.n_heads * c.head_dim),
                  f"{p}.ffn_gate_inp.weight": r(c.n_experts, c.hidden_size),
                  f"{p}.ffn_gate_exps.weight": r(c.n_experts, c.ffn_size, c.hidden_size),
                  f"{p}.ffn_up_exps.weight": r(c.n_experts, c.ffn_size, c.hidden_size),
                  f"{p}.ffn_down_exps.weight": r(c.n_experts, c.hidden_size, c.ffn_size)})
    return t


def write_tiny_llama(path: Path, arch: str = "llama", tensors: dict | None = None,
                     drop_keys: tuple[str, ...] = (), **overrides) -> Path:
    c = llama_config(**overrides)
    meta = {**llama.gguf_metadata(c), **byte_tokenizer_metadata()}
    meta = {k.replace("llama.", f"{arch}.", 1): v for k, v in meta.items() if k not in drop_keys}
    tensors = llama_tensors(c) if tensors is None else tensors
    return write_gguf(path, arch, meta, [(n, t, F32) for n, t in tensors.items()])
