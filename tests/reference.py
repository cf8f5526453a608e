"""Shared runner: build tiny random transformers models, save them, compare Strata against them.

Norm weights are randomised (transformers initialises them to ones, which hides bugs in
norm handling), and every comparison is against transformers' own class.
"""

from __future__ import annotations

import functools

from pathlib import Path

import torch

PROMPT_LEN = 64


def randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter (norms included) random values so no branch is an identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def qwen3next_config(vocab: int, **overrides):
    """The tests' tiny Qwen3-Next: both layer kinds, GQA in the DeltaNet, d_k != d_v, partial rope."""
    from transformers import Qwen3NextConfig

    shapes = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, rms_norm_eps=1e-6)
    return Qwen3NextConfig(**{**shapes, **overrides})


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def gguf_roundtrip(model: torch.nn.Module, dense, experts) -> torch.nn.Module:
    """A copy of `model` whose matrices went through gguf-py's quantize and dequantize (type
    `experts` for the experts' weights, `dense` for the others; norms, vectors and the router as
    they are): the weights a file converted with those types holds, for transformers to run."""
    import copy

    import gguf.quants

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim < 2 or "norm" in name or name.endswith("mlp.gate.weight"):
                continue
            qtype = experts if "experts" in name else dense
            p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.detach().numpy(), qtype), qtype)))
    return ref


def prompt(vocab: int, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def greedy_decode(model, cache, first: torch.Tensor, n: int):
    """n greedy steps from `first` (B, 1); -> (per-step token lists, last tokens (B, 1))."""
    out, tokens = [], first
    for _ in range(n):
        tokens = model(tokens, cache, last_only=True)[:, 0].argmax(-1, keepdim=True)
        out.append(tokens[:, 0].tolist())
    return out, tokens


@torch.inference_mode()
def check_merge_and_leave(model, prompts: list[list[int]], inspect=lambda merged: None) -> None:
    """Continuous batching: two requests prefilled alone, merged with `extend`, decoded together,
    then one leaves with `select`; every token equals the request decoded alone. `inspect(merged)`
    checks the merged cache's layers before decoding."""
    def prefill(p):
        cache = model.new_cache(1)
        return cache, model(torch.tensor([p]), cache, last_only=True)[:, 0].argmax(-1, keepdim=True)

    alone = []
    for p in prompts:
        cache, first = prefill(p)
        alone.append([t[0] for t in greedy_decode(model, cache, first, 6)[0]])
    (merged, first0), (other, first1) = prefill(prompts[0]), prefill(prompts[1])
    merged.extend(other)
    inspect(merged)
    steps, last = greedy_decode(model, merged, torch.cat([first0, first1]), 3)
    assert [[s[r] for s in steps] for r in (0, 1)] == [a[:3] for a in alone]
    merged.select(torch.tensor([1]))
    rest, _ = greedy_decode(model, merged, last[1:], 3)
    assert [s[0] for s in rest] == alone[1][3:]


@functools.cache
def cached_hf_greedy(model, ids: tuple[int, ...], n: int) -> list[int]:
    """transformers' greedy continuation, computed once per (model, prompt, length) in a session."""
    return hf_greedy(model, list(ids), n)


@functools.cache
def cached_engine(path, **options):
    """One Strata engine per (path, options) in a session: loading is the slow part of these tests."""
    import strata

    return strata.load(path, **options)


@torch.inference_mode()
def batch_and_verify_logits(model, seqs: list[list[int]], lens: list[int]) -> list[list[tuple[int, torch.Tensor]]]:
    """Two sequences decoded as one batch after their right-padded prompts (`lens` tokens each):
    two batch steps, a speculative verify pass (the cache tracking, 3 and 2 positions, row 0 then
    dropping 1 by `ModelCache.rollback`), two more batch steps from the kept tokens. Returns per
    row the (position, logits) of every position fed after the prompt, to compare with each
    sequence decoded alone (each row feeds seqs[r] in order; at least lens[r] + 6 tokens)."""
    got = [[], []]

    def feed(cache, pos, n):  # row r feeds seqs[r][pos[r] : pos[r] + n[r]]
        tokens = torch.zeros(2, max(n), dtype=torch.long)
        for r in range(2):
            tokens[r, :n[r]] = torch.tensor(seqs[r][pos[r]:pos[r] + n[r]])
        logits = model(tokens, cache, n_new=torch.tensor(n))
        for r in range(2):
            got[r] += [(pos[r] + j, logits[r, j]) for j in range(n[r])]

    cache = model.new_cache(2)
    tokens = torch.zeros(2, max(lens), dtype=torch.long)
    for r in range(2):
        tokens[r, :lens[r]] = torch.tensor(seqs[r][:lens[r]])
    model(tokens, cache, n_new=torch.tensor(lens))
    pos = list(lens)
    for _ in range(2):
        feed(cache, pos, [1, 1])
        pos = [p + 1 for p in pos]
    cache.track()
    feed(cache, pos, [3, 2])
    cache.rollback(torch.tensor([1, 0]))
    pos = [pos[0] + 2, pos[1] + 2]
    cache.track(False)
    for _ in range(2):
        feed(cache, pos, [1, 1])
        pos = [p + 1 for p in pos]
    return got
