"""Routing traces: every decision (step, layer, token position, expert ids, weights).

Kept in memory while the model runs and written once, as one compressed .npz, when the
engine closes: the only file inference writes, and only when `--trace-experts` asks.

Format version 2 adds, per record, whether its forward was a prefill, and the prefetcher's
predictions: the experts the next layer's router named on the current hidden state, each
tagged with the record it came before (`pred_before`), so a replay issues the prefetch
copies exactly where the runtime does. Version 1 traces (no `version` array) still load:
every record counts as decode and there are no predictions.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from strata.errors import StrataError

VERSION = 2


class TraceRecorder:
    """Collects one record per MoE call and one per prediction; `save` writes them in one go."""

    def __init__(self, n_experts: int, meta: dict | None = None, expert_bytes: dict[int, int] | None = None):
        self.n_experts = n_experts
        self.meta = dict(meta or {})
        self.expert_bytes = dict(expert_bytes or {})
        self.rows: list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]] = []
        self.prefill: list[bool] = []
        self.predictions: list[tuple[int, int, np.ndarray]] = []  # (before record i, layer, distinct experts)
        self.step = 0
        self.in_prefill = False

    def next_step(self, prefill: bool = False) -> None:
        """A new forward pass (a prefill chunk, or a decode step) begins."""
        self.step += 1
        self.in_prefill = prefill

    def record(self, layer: int, positions: torch.Tensor | None, ids: torch.Tensor, weights: torch.Tensor):
        n = ids.shape[0]
        pos = positions.cpu().numpy() if positions is not None and positions.numel() == n else np.full(n, -1)
        self.rows.append((self.step, layer, pos.astype(np.int32), ids.cpu().numpy().astype(np.int32),
                          weights.detach().float().cpu().numpy().astype(np.float16)))
        self.prefill.append(self.in_prefill)

    def predicted(self, layer: int, experts: list[int], source: str | None = None) -> None:
        """The prefetcher named `experts` for `layer`, before the next record; `source` says how it
        predicts (kept in the trace's meta, so a replay can say where its predictions came from)."""
        if source:
            self.meta.setdefault("predictions", source)
        self.predictions.append((len(self.rows), layer, np.asarray(experts, dtype=np.int32)))

    def save(self, path) -> Path:
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        k = self.rows[0][3].shape[1] if self.rows else 0
        counts = np.array([r[3].shape[0] for r in self.rows], dtype=np.int64)
        n_layers = max([r[1] for r in self.rows] + list(self.expert_bytes), default=-1) + 1
        np.savez_compressed(
            path, version=np.int64(VERSION), step=np.array([r[0] for r in self.rows], dtype=np.int32),
            layer=np.array([r[1] for r in self.rows], dtype=np.int32), tokens=counts,
            position=_cat([r[2] for r in self.rows], (0,), np.int32),
            ids=_cat([r[3] for r in self.rows], (0, k), np.int32),
            weights=_cat([r[4] for r in self.rows], (0, k), np.float16),
            prefill=np.array(self.prefill, dtype=bool),
            pred_before=np.array([p[0] for p in self.predictions], dtype=np.int64),
            pred_layer=np.array([p[1] for p in self.predictions], dtype=np.int32),
            pred_count=np.array([len(p[2]) for p in self.predictions], dtype=np.int64),
            pred_ids=_cat([p[2] for p in self.predictions], (0,), np.int32),
            expert_bytes=np.array([self.expert_bytes.get(i, 0) for i in range(n_layers)], dtype=np.int64),
            n_experts=np.int64(self.n_experts), meta=np.array(repr(self.meta)))
        return path


def _cat(parts, empty_shape, dtype):
    return np.concatenate(parts) if parts else np.zeros(empty_shape, dtype=dtype)


@dataclass(slots=True)
class Trace:
    """A loaded trace: per record (step, layer, token count, prefill); per token (position, ids, weights);
    per prediction (the record it precedes, layer, experts)."""

    step: np.ndarray
    layer: np.ndarray
    tokens: np.ndarray
    position: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    n_experts: int
    version: int = 1
    prefill: np.ndarray | None = None  # per record; None in version 1 (all decode)
    predictions: list[tuple[int, int, list[int]]] = field(default_factory=list)
    expert_bytes: np.ndarray | None = None  # per layer, bytes of one expert; None when unknown
    meta: dict = field(default_factory=dict)  # what recorded it: model, prediction source, log files

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.layer.tolist()))

    @property
    def has_predictions(self) -> bool:
        return bool(self.predictions)

    def requests(self) -> list[tuple[int, list[int]]]:
        """Per record, in order: (layer, distinct experts it used): the unit the cache serves."""
        out, start = [], 0
        for layer, n in zip(self.layer.tolist(), self.tokens.tolist()):
            out.append((layer, sorted(set(self.ids[start:start + n].reshape(-1).tolist()))))
            start += n
        return out

    def request_counts(self) -> list[list[int]]:
        """Per record, aligned with `requests()`: how many token-routings went to each expert."""
        out, start = [], 0
        for n in self.tokens.tolist():
            _, counts = np.unique(self.ids[start:start + n].reshape(-1), return_counts=True)
            out.append(counts.tolist())
            start += n
        return out

    def prefill_flags(self) -> list[bool]:
        return self.prefill.tolist() if self.prefill is not None else [False] * len(self.layer)

    def predictions_by_record(self) -> dict[int, list[tuple[int, list[int]]]]:
        """Record index -> [(layer, predicted experts)] issued just before that record."""
        out: dict[int, list[tuple[int, list[int]]]] = {}
        for before, layer, experts in self.predictions:
            out.setdefault(before, []).append((layer, experts))
        return out


def trace_path(path) -> Path:
    """`path` itself, or `path.npz` when only that exists (`--trace-experts t` writes t.npz)."""
    path = Path(path)
    with_suffix = path.with_name(path.name + ".npz")
    return with_suffix if not path.exists() and path.suffix != ".npz" and with_suffix.exists() else path


def load_trace(path) -> Trace:
    path = trace_path(path)
    if not path.exists():
        raise StrataError(f"{path}: no such trace", "record one with strata run --trace-experts FILE")
    try:
        with np.load(path, allow_pickle=False) as z:
            trace = Trace(z["step"], z["layer"], z["tokens"], z["position"], z["ids"], z["weights"],
                          int(z["n_experts"]))
            if "version" in z.files:
                _load_v2(trace, z)
            trace.meta = _meta(z)
            return trace
    except (OSError, KeyError, ValueError) as e:
        raise StrataError(f"{path}: not an expert trace ({e})",
                          "record one with strata run --trace-experts FILE") from None


def _meta(z) -> dict:
    try:
        meta = ast.literal_eval(str(z["meta"])) if "meta" in z.files else {}
    except (ValueError, SyntaxError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _load_v2(trace: Trace, z) -> None:
    trace.version = int(z["version"])
    if trace.version > VERSION:
        raise ValueError(f"format version {trace.version}, this Strata reads up to {VERSION}")
    trace.prefill = z["prefill"]
    bounds = np.concatenate([[0], np.cumsum(z["pred_count"])]).tolist()
    ids = z["pred_ids"].tolist()
    trace.predictions = [(b, layer, ids[bounds[i]:bounds[i + 1]])
                         for i, (b, layer) in enumerate(zip(z["pred_before"].tolist(), z["pred_layer"].tolist()))]
    trace.expert_bytes = z["expert_bytes"]
