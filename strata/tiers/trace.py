"""Routing traces: every decision (step, layer, token position, expert ids, weights).

Kept in memory while the model runs and written once, as one compressed .npz, when the
engine closes: the only file inference writes, and only when `--trace-experts` asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strata.errors import StrataError


class TraceRecorder:
    """Collects one record per MoE call; `save` writes them in one go."""

    def __init__(self, n_experts: int, meta: dict | None = None):
        self.n_experts = n_experts
        self.meta = dict(meta or {})
        self.rows: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []
        self.step = 0

    def next_step(self) -> None:
        """A new forward pass (prefill chunk or decode step) begins."""
        self.step += 1

    def record(self, layer: int, positions: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor):
        n = ids.shape[0]
        pos = positions.cpu().numpy() if positions is not None and positions.numel() == n else np.full(n, -1)
        self.rows.append((self.step, layer, pos.astype(np.int32), ids.cpu().numpy().astype(np.int32),
                          weights.detach().float().cpu().numpy().astype(np.float16)))

    def save(self, path) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        k = self.rows[0][3].shape[1] if self.rows else 0
        counts = np.array([r[3].shape[0] for r in self.rows], dtype=np.int64)
        np.savez_compressed(
            path, step=np.array([r[0] for r in self.rows], dtype=np.int32),
            layer=np.array([r[1] for r in self.rows], dtype=np.int32), tokens=counts,
            position=_cat([r[2] for r in self.rows], (0,), np.int32),
            ids=_cat([r[3] for r in self.rows], (0, k), np.int32),
            weights=_cat([r[4] for r in self.rows], (0, k), np.float16),
            n_experts=np.int64(self.n_experts), meta=np.array(repr(self.meta)))
        return path


def _cat(parts, empty_shape, dtype):
    return np.concatenate(parts) if parts else np.zeros(empty_shape, dtype=dtype)


@dataclass(slots=True)
class Trace:
    """A loaded trace: per record (step, layer, token count); per token (position, ids, weights)."""

    step: np.ndarray
    layer: np.ndarray
    tokens: np.ndarray
    position: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    n_experts: int

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.layer.tolist()))

    def requests(self) -> list[tuple[int, list[int]]]:
        """Per record, in order: (layer, distinct experts it used): the unit the cache serves."""
        out, start = [], 0
        for layer, n in zip(self.layer.tolist(), self.tokens.tolist()):
            out.append((layer, sorted(set(self.ids[start:start + n].reshape(-1).tolist()))))
            start += n
        return out


def load_trace(path) -> Trace:
    try:
        with np.load(path, allow_pickle=False) as z:
            return Trace(z["step"], z["layer"], z["tokens"], z["position"], z["ids"], z["weights"],
                         int(z["n_experts"]))
    except (OSError, KeyError, ValueError) as e:
        raise StrataError(f"{path}: not an expert trace ({e})",
                          "record one with strata run --trace-experts FILE") from None
