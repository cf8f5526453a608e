"""Public per-token routing logs of real MoE models -> Strata expert traces (`strata cache-sim`).

    .venv/bin/python bench/convert_routing_log.py LOG.jsonl [LOG2.jsonl ...] -o trace.npz

Two JSON-lines layouts that vLLM users publish are read (the layout is detected per file):

- `speculative-moe` (Mixtral-8x7B-Instruct, github.com/Mario928/speculative-moe): one line per
  (token, layer), `{"dataset", "problem_id", "layer", "experts", "gating_probs", ...}`.
  With `token_idx` the file holds decode tokens only, one request at a time: each
  (problem, token) is one forward pass over all layers. With `token_pos` (their raw log) the
  lines are in execution order, prefill included: a forward ends where the layer number drops,
  and a forward of more than one token is a prefill.
- `vllm-moe-logger` (Qwen1.5-MoE-A2.7B-Chat, e.g. github.com/weiran0129/vLLM-MoE-Logger): a
  `{"type": "meta", "model_id", "layers_logged", "top_k"}` line, then `{"type": "route",
  "token_idx", "layer", "topk_ids", "topk_weights"}` per token, where `token_idx` counts
  tokens inside one forward (it restarts at 0 with each forward). Such loggers record one
  layer per run; several files (one per layer, same prompts and seed) are merged forward by
  forward, and refused if their forwards differ in size. vLLM's start-up profiling forwards
  (every token routed alike) are dropped; a forward over twice as wide as the median one is
  marked prefill (a batched prompt), the others decode (a batch of decode steps shrinks by one
  as each sequence ends, so 25 beside a median of 24 is still decode).
- the same layout with one `token_idx` counter over the whole run (it never restarts, e.g.
  OLMoE-1B-7B, github.com/KaxitPandya/cerebras-assesment2): the lines do not say where a
  forward ends, so `--forward-sizes` must say it (e.g. `2048,1377,25*46,24*81`: tokens per
  forward in execution order, `N*K` for K forwards of N tokens), derived from what the run
  did; bench/routing_logs.md says how. A forward of one repeated routing is still dropped.

With `--predict`, the trace also holds next-layer predictions made from the routing alone
(bench/routing_predictor.py: which experts of layer l+1 followed the token's experts at layer
l in earlier forwards), so `strata cache-sim` can show prefetch on and off on real routing.
Only adjacent logged layers get predictions; they are not the runtime's router predictions.

Nothing is shipped from those repositories (they carry no licence); the README in
`bench/routing_logs.md` says how to fetch the logs and which commands made the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from strata.errors import StrataError
from strata.tiers.trace import TraceRecorder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing_predictor import SOURCE, CooccurrencePredictor  # noqa: E402

# Routed experts per layer and, at about 4.5 bits per weight (Q4_K_M), the bytes of one expert
# (gate, up and down projections): what a copy moves. From the models' config.json files.
KNOWN_MODELS = {
    "mixtral": {"n_experts": 8, "n_layers": 32, "expert_bytes": 3 * 4096 * 14336 * 9 // 16},
    "qwen1.5-moe": {"n_experts": 60, "n_layers": 24, "expert_bytes": 3 * 2048 * 1408 * 9 // 16},
    "olmoe": {"n_experts": 64, "n_layers": 16, "expert_bytes": 3 * 2048 * 1024 * 9 // 16},
}

Forward = tuple[bool, dict[int, list[tuple[list[int], list[float]]]]]  # (prefill, layer -> per token (ids, weights))


def read_lines(path: Path) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise StrataError(f"{path}:{n}: not JSON ({e.msg})", "give a JSON-lines routing log") from None
    if not out:
        raise StrataError(f"{path}: empty routing log")
    return out


def layout(rows: list[dict]) -> str:
    first = rows[0]
    if first.get("type") in ("meta", "route"):
        return "vllm-moe-logger"
    if "experts" in first and "layer" in first:
        return "speculative-moe"
    raise StrataError(f"unknown routing-log layout (first line has keys {sorted(first)})",
                      "see bench/convert_routing_log.py for the layouts it reads")


def speculative_moe_forwards(rows: list[dict]) -> list[Forward]:
    if "token_idx" in rows[0]:  # decode tokens only, one request at a time
        by_token: dict[tuple, dict[int, list]] = {}
        for r in rows:
            by_token.setdefault((r["problem_id"], r["token_idx"]), {})[r["layer"]] = [(r["experts"], r["gating_probs"])]
        return [(False, dict(sorted(layers.items()))) for _, layers in sorted(by_token.items())]
    forwards: list[Forward] = []
    current: dict[int, list] = {}
    last = -1
    for r in rows:  # execution order: a forward ends where the layer number drops
        if r["layer"] < last and current:
            forwards.append(_closed(current))
            current = {}
        current.setdefault(r["layer"], []).append((r["experts"], r["gating_probs"]))
        last = r["layer"]
    if current:
        forwards.append(_closed(current))
    return forwards


def _closed(layers: dict[int, list]) -> Forward:
    return (max(len(v) for v in layers.values()) > 1, layers)


def parse_forward_sizes(text: str) -> list[int]:
    """`2048,1377,25*46` -> [2048, 1377, 25, 25, ...] (tokens per forward, in execution order)."""
    out = []
    for part in text.split(","):
        size, _, times = part.strip().partition("*")
        try:
            n, k = int(size), int(times or 1)
        except ValueError:
            raise StrataError(f"--forward-sizes: {part.strip()!r} is not N or N*K",
                              "write e.g. --forward-sizes 2048,1377,25*46") from None
        if n < 1 or k < 1:
            raise StrataError(f"--forward-sizes: {part.strip()!r} must be positive")
        out += [n] * k
    return out


def _split(routes: list[dict], sizes: list[int] | None) -> list[list[dict]]:
    """The lines of one log, forward by forward: where `token_idx` restarts, or by `sizes`."""
    if sizes is None:
        if routes and all(r["token_idx"] == i for i, r in enumerate(routes)) and len(routes) > 1:
            raise StrataError("token_idx never restarts in this log, so its forward passes cannot be told apart",
                              "give --forward-sizes (tokens per forward, in order)")
        forwards, current = [], []
        for r in routes:
            if r["token_idx"] == 0 and current:
                forwards.append(current)
                current = []
            current.append(r)
        return forwards + [current] if current else forwards
    if sum(sizes) != len(routes):
        raise StrataError(f"--forward-sizes add up to {sum(sizes)} tokens, but the log has {len(routes)}",
                          "give sizes that cover every logged token")
    ends = np.cumsum(sizes)
    return [routes[e - n:e] for n, e in zip(sizes, ends)]


def logger_forwards(files: list[list[dict]], sizes: list[int] | None = None) -> list[Forward]:
    """Merge one-layer-per-file logs forward by forward."""
    per_file = []
    for rows in files:
        forwards = _split([r for r in rows if r.get("type") == "route"], sizes)
        per_file.append([f for f in forwards if not _profiling(f)])
    sizes = [[len(f) for f in forwards] for forwards in per_file]
    if any(s != sizes[0] for s in sizes):
        raise StrataError("the logs' forward passes differ in size, so they are not runs of the same prompts",
                          "merge only logs of one layer each from identical runs")
    width = float(np.median(sizes[0])) if sizes[0] else 0.0
    out: list[Forward] = []
    for i, n in enumerate(sizes[0]):
        layers: dict[int, list] = {}
        for forwards in per_file:
            for r in forwards[i]:
                layers.setdefault(r["layer"], []).append((r["topk_ids"], r["topk_weights"]))
        out.append((n > 2 * width, dict(sorted(layers.items()))))
    return out


def _profiling(forward: list[dict]) -> bool:
    """vLLM's start-up profiling and warm-up runs feed dummy tokens: every token routed alike."""
    return len(forward) > 1 and len({tuple(r["topk_ids"]) for r in forward}) == 1


def model_of(rows: list[dict], name: str | None) -> str | None:
    text = (name or rows[0].get("model_id") or "").lower()
    if not text and "gating_probs" in rows[0]:
        text = "mixtral"  # speculative-moe logs Mixtral-8x7B-Instruct only
    return next((m for m in KNOWN_MODELS if m in text), None)


def convert(paths: list[Path], out: Path, model: str | None = None, n_experts: int | None = None,
            predict: bool = False, forward_sizes: list[int] | None = None) -> dict:
    files = [read_lines(p) for p in paths]
    kinds = {layout(rows) for rows in files}
    if len(kinds) > 1:
        raise StrataError("the logs are of different layouts", "convert each kind on its own")
    if kinds == {"speculative-moe"}:
        forwards = [f for rows in files for f in speculative_moe_forwards(rows)]
    else:
        forwards = logger_forwards(files, forward_sizes)
    known = KNOWN_MODELS.get(model_of(files[0], model) or "", {})
    top = max(e for _, layers in forwards for toks in layers.values() for ids, _ in toks for e in ids)
    n_experts = n_experts or known.get("n_experts") or files[0][0].get("num_experts") or top + 1
    if top >= n_experts:
        raise StrataError(f"expert id {top} in the log, but --n-experts is {n_experts}", "give the model's expert count")
    n_layers = max(known.get("n_layers", 0), max(l for _, layers in forwards for l in layers) + 1)
    expert_bytes = {layer: known["expert_bytes"] for layer in range(n_layers)} if known else {}
    meta = {"source": [str(p) for p in paths], "model": model_of(files[0], model) or "unknown"}
    rec = TraceRecorder(n_experts, meta, expert_bytes)
    predictor = CooccurrencePredictor(n_layers + 1, n_experts) if predict else None
    position, predicted = 0, 0
    for prefill, layers in forwards:
        rec.next_step(prefill)
        for layer, tokens in layers.items():
            ids = torch.tensor([t[0] for t in tokens], dtype=torch.int32)
            weights = torch.tensor([t[1] for t in tokens], dtype=torch.float32)
            rec.record(layer, torch.arange(position, position + len(tokens)), ids, weights)
            after = layers.get(layer + 1)
            if predictor is not None and after is not None and len(after) == len(tokens):
                named = predictor.predict(layer, ids.numpy())
                if named:  # issued before layer + 1's record, as the runtime's prefetch is
                    rec.predicted(layer + 1, named, SOURCE)
                    predicted += 1
                predictor.observe(layer, ids.numpy(), np.array([t[0] for t in after]))
        if predictor is not None:
            predictor.end_forward()
        position += max(len(t) for t in layers.values())
    path = rec.save(out)
    tokens = [max(len(t) for t in layers.values()) for _, layers in forwards]
    return {"path": str(path), "forwards": len(forwards), "layers": sorted({l for _, ls in forwards for l in ls}),
            "n_experts": n_experts, "top_k": int(ids.shape[1]), "predictions": predicted,
            "prefill_tokens": sum(n for n, (p, _) in zip(tokens, forwards) if p),
            "decode_tokens": sum(n for n, (p, _) in zip(tokens, forwards) if not p),
            "max_batch": max(n for n, (p, _) in zip(tokens, forwards) if not p) if any(not p for p, _ in forwards) else 0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path, help="JSON-lines routing logs (several: one layer each, merged)")
    p.add_argument("-o", "--out", type=Path, required=True, help="the trace to write (.npz)")
    p.add_argument("--model", help="model name, when the log does not say (mixtral, qwen1.5-moe, olmoe)")
    p.add_argument("--n-experts", type=int, help="routed experts per layer, when the model is not known")
    p.add_argument("--forward-sizes", metavar="N,N*K,...",
                   help="tokens per forward in execution order, for a log whose token_idx never restarts")
    p.add_argument("--predict", action="store_true",
                   help="add next-layer predictions made from the routing alone (bench/routing_predictor.py)")
    args = p.parse_args(argv)
    try:
        sizes = parse_forward_sizes(args.forward_sizes) if args.forward_sizes else None
        info = convert(args.logs, args.out, args.model, args.n_experts, args.predict, sizes)
    except (StrataError, OSError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
