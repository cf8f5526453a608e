"""The PLE n-gram hash: token ids -> rows of the n-gram embedding table (Qwen4-Exp).

    ctx   = the token and its ngram_size - 1 predecessors, where everything at or before an EOS
            in the window (and everything before the sequence start) reads as EOS
    mixed = (ctx[0] * m[0]) ^ (ctx[1] * m[1]) ^ ... ^ (ctx[n-1] * m[n-1])   for n = 2..ngram_size
    row   = mixed % vocab[h] + offset[h]       for the heads_per_ngram heads h of order n

in uint64 (transformers' int64 never overflows: m < 2^63 / vocab). The multipliers m come from a
splitmix64 of the seed, the per-head moduli are consecutive primes from `ngram_vocab_size_base`
and the offsets their running sum (transformers' `Qwen4ExpTextNGramEmbedding`); a GGUF carries
all three as llama.cpp writes them (`ple.layer_multipliers`, `ple.head_vocab_sizes`,
`ple.head_offsets`, uint64 arrays). A format definition: the config readers and the table reader
(`strata.tiers.ngram_table`) both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from strata.errors import BadModelFile

TABLE = "per_layer_token_embd.weight"  # llama.cpp's name for the joined table

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_PRIME_1 = 10007


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd multipliers below 2^63 / vocab, one per n-gram position (transformers' construction)."""
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + _PRIME_1 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, n_heads: int, ple_index: int) -> list[int]:
    """Head h of PLE module k hashes into the (k * n_heads + h + 1)-th prime >= base."""
    sizes, p = [], base - 1
    for g in range((ple_index + 1) * n_heads):
        p += 1
        while not _is_prime(p):
            p += 1
        if g >= ple_index * n_heads:
            sizes.append(p)
    return sizes


@dataclass(frozen=True)
class NgramHash:
    """Token ids -> table rows; pure, so rows can be computed (and read) before the forward."""

    ngram_size: int
    heads_per_ngram: int
    multipliers: tuple[int, ...]
    vocab_sizes: tuple[int, ...]  # per head: the modulus
    offsets: tuple[int, ...]  # per head: its first row
    eos: int

    @property
    def n_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def context(self) -> int:
        return self.ngram_size - 1

    @property
    def min_rows(self) -> int:
        return max(o + v for o, v in zip(self.offsets, self.vocab_sizes))

    def __post_init__(self):
        if self.ngram_size < 2 or self.heads_per_ngram < 1:
            raise BadModelFile(f"PLE n-gram size {self.ngram_size} / heads per n-gram {self.heads_per_ngram} "
                               "are out of range", "the n-gram size must be at least 2")
        for what, values, need in (("multipliers", self.multipliers, self.ngram_size),
                                   ("head vocab sizes", self.vocab_sizes, self.n_heads),
                                   ("head offsets", self.offsets, self.n_heads)):
            if len(values) < need:
                raise BadModelFile(f"PLE {what}: {len(values)} entries, at least {need} are required")
        if any(v <= 0 for v in self.vocab_sizes[:self.n_heads]):
            raise BadModelFile("a PLE head has a vocabulary size of 0")

    @classmethod
    def from_config(cls, cfg: dict, ple_index: int = 0) -> "NgramHash":
        n, per = cfg.get("ngram_size", 3), cfg.get("heads_per_ngram", 8)
        heads = (n - 1) * per
        sizes = head_vocab_sizes(cfg.get("ngram_vocab_size_base", 20_000_000), heads, ple_index)
        offsets = [sum(sizes[:h]) for h in range(heads)]
        mult = layer_multipliers(cfg["vocab_size"], n, ple_index, cfg.get("seed", 1234))
        return cls(n, per, tuple(mult), tuple(sizes), tuple(offsets), eos_of(cfg))

    @classmethod
    def from_gguf(cls, meta: dict, arch: str) -> "NgramHash":
        def need(key):
            if f"{arch}.{key}" not in meta:
                raise BadModelFile(f"GGUF metadata key '{arch}.{key}' is missing",
                                   "the file lists PLE layers but not the n-gram hash; re-convert it")
            return meta[f"{arch}.{key}"]

        return cls(int(need("ple.ngram_size")), int(need("ple.heads_per_ngram")),
                   tuple(int(v) for v in need("ple.layer_multipliers")),
                   tuple(int(v) for v in need("ple.head_vocab_sizes")),
                   tuple(int(v) for v in need("ple.head_offsets")), int(need("ple.eos_token_id")))

    def initial_context(self, batch: int) -> torch.Tensor:
        return torch.full((batch, self.context), self.eos, dtype=torch.long)

    def rows(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """tokens (B, T), context (B, ngram_size-1: the previous tokens, EOS-filled at the start)
        -> (B, T, n_heads) int64 row ids."""
        hist = torch.cat([context.to(tokens.device), tokens], dim=1).long().cpu()
        shifted = [self._shift(hist, s).numpy().astype(np.uint64) for s in range(self.ngram_size)]
        mult = [np.uint64(m) for m in self.multipliers]
        out = []
        with np.errstate(over="ignore"):  # uint64 wraps as llama.cpp's does; transformers' never reaches it
            mixed = shifted[0] * mult[0]
            for n in range(2, self.ngram_size + 1):
                mixed = mixed ^ (shifted[n - 1] * mult[n - 1])
                heads = slice((n - 2) * self.heads_per_ngram, (n - 1) * self.heads_per_ngram)
                sizes = np.array(self.vocab_sizes[heads], dtype=np.uint64)
                offs = np.array(self.offsets[heads], dtype=np.uint64)
                out.append(mixed[..., None] % sizes + offs)
        ids = np.concatenate(out, axis=-1).astype(np.int64)
        return torch.from_numpy(ids[:, self.context:])

    def next_context(self, context: torch.Tensor, tokens: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
        """Each row's last ngram_size-1 real tokens after this step (rows with none keep theirs)."""
        hist = torch.cat([context.to(tokens.device), tokens], dim=1).long()
        idx = n_new.to(hist.device)[:, None] + torch.arange(self.context, device=hist.device)
        return hist.gather(1, idx).cpu()

    def _shift(self, ids: torch.Tensor, shift: int) -> torch.Tensor:
        """transformers' `_shift_right_ignore_eos`: the token `shift` back, or EOS across a reset."""
        if shift == 0:
            return ids
        b, n = ids.shape
        pos = torch.arange(n)
        eos_at = torch.where(ids == self.eos, pos, -1)
        last = torch.cummax(eos_at, dim=1).values
        previous = torch.cat([eos_at.new_full((b, 1), -1), last[:, :-1]], dim=1)
        in_segment = pos[None] - (previous + 1)
        src = pos - shift
        shifted = ids.gather(1, src.clamp_min(0)[None].expand(b, -1))
        valid = (in_segment >= shift) & (src[None] >= 0)
        return torch.where(valid, shifted, torch.full_like(ids, self.eos))


def eos_of(cfg: dict) -> int:
    eos = cfg.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None  # transformers resets on the first
    if eos is None:
        raise BadModelFile("config.json has no eos_token_id", "PLE needs it: the n-gram context resets on EOS")
    return int(eos)


def padded_rows(hash_: NgramHash, divisor: int) -> int:
    """The table's row count when the checkpoint pads it to a multiple of `divisor`."""
    total = sum(hash_.vocab_sizes[:hash_.n_heads])
    return math.ceil(total / divisor) * divisor
