"""Pure sampling functions: logits in, token ids out. No model state lives here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import BadOption


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        checks = [(self.temperature >= 0, "temperature must be >= 0"),
                  (self.top_k >= 0, "top_k must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.repetition_penalty > 0, "repetition_penalty must be > 0")]
        for ok, message in checks:
            if not ok:
                raise BadOption(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: list[list[int]], penalty: float) -> torch.Tensor:
    """CTRL-style penalty on tokens already in each row's context (as transformers does)."""
    if penalty == 1.0:
        return logits
    logits = logits.clone()
    for row, ids in enumerate(seen):
        if not ids:
            continue
        idx = torch.tensor(sorted(set(ids)), dtype=torch.long)
        vals = logits[row, idx]
        logits[row, idx] = torch.where(vals < 0, vals * penalty, vals / penalty)
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches p (always the top one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    drop = cum - torch.softmax(sorted_logits, dim=-1) >= p
    drop[..., 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    limit = probs.max(dim=-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < limit, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, seen: list[list[int]],
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    logits = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    logits = filter_min_p(filter_top_p(filter_top_k(logits, params.top_k), params.top_p), params.min_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
