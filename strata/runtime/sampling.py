"""Pure sampling functions: logits in, token ids out. No model state lives here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from strata.errors import BadOption

# Past these, float32 logits overflow (logits / 1e-300 is inf, and softmax of inf is NaN).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
MIN_PENALTY, MAX_PENALTY = 1e-2, 100.0
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes an int64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise BadOption(f"{name} must be a finite number, not {value!r}")
        for name in ("top_k", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise BadOption(f"{name} must be an integer, not {value!r}")
        t, rp = self.temperature, self.repetition_penalty
        checks = [(t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE,
                   f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], not {t!r}"),
                  (self.top_k >= 0, f"top_k must be >= 0, not {self.top_k!r}"),
                  (0 < self.top_p <= 1, f"top_p must be in (0, 1], not {self.top_p!r}"),
                  (0 <= self.min_p <= 1, f"min_p must be in [0, 1], not {self.min_p!r}"),
                  (MIN_PENALTY <= rp <= MAX_PENALTY,
                   f"repetition_penalty must be in [{MIN_PENALTY:g}, {MAX_PENALTY:g}] (1 = off), not {rp!r}"),
                  (self.seed is None or 0 <= self.seed <= MAX_SEED,
                   f"seed must be in 0..2^63-1, not {self.seed!r}")]
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


def probs(logits: torch.Tensor, params: SamplingParams, seen: list[list[int]]) -> torch.Tensor:
    """The distribution `sample` draws from when not greedy: logits (B, V) -> probabilities (B, V)
    after the repetition penalty, temperature, top-k, top-p and min-p."""
    x = apply_repetition_penalty(logits.float(), seen, params.repetition_penalty) / params.temperature
    x = filter_min_p(filter_top_p(filter_top_k(x, params.top_k), params.top_p), params.min_p)
    return torch.softmax(x, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, seen: list[list[int]],
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    if params.greedy:
        return apply_repetition_penalty(logits.float(), seen, params.repetition_penalty).argmax(dim=-1)
    return torch.multinomial(probs(logits, params, seen), 1, generator=generator)[:, 0]
