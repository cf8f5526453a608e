"""/metrics in Prometheus' text exposition format (version 0.0.4).

Scheduler numbers always; engine numbers from `engine.stats` when present. The tiered runtime's
expert cache reports through `engine.stats` keys starting with one of `ENGINE_STAT_PREFIXES`
(e.g. `expert_cache_hits`), which come out as `strata_<key>` gauges with no code change here;
anything else can be added with a metrics source passed to `create_app(metrics_sources=...)`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_STAT_PREFIXES = ("expert_", "cache_", "tier_")


@dataclass(slots=True)
class Metric:
    name: str  # without the strata_ prefix
    kind: str  # "counter", "gauge" or "summary"
    help: str
    samples: list[tuple[dict, float]] = field(default_factory=list)  # (labels, value)
    suffixes: list[str] | None = None  # per sample, appended to the name (a summary's _sum, _count)

    @classmethod
    def one(cls, name: str, kind: str, help: str, value: float, **labels) -> "Metric":
        return cls(name, kind, help, [(labels, value)])

    @classmethod
    def summary(cls, name: str, help: str, total: float, count: float) -> "Metric":
        return cls(name, "summary", help, [({}, total), ({}, count)], ["_sum", "_count"])


MetricsSource = Callable[[], Iterable[Metric]]


def scheduler_metrics(stats: dict, model_name: str) -> list[Metric]:
    m = Metric.one
    return [
        m("generated_tokens_total", "counter", "Tokens sampled, over all requests.", stats["generated_tokens"]),
        m("prompt_tokens_total", "counter", "Prompt tokens prefilled.", stats["prompt_tokens"]),
        m("tokens_per_second", "gauge", "Tokens sampled per second over the last 10 s.", stats["tokens_per_s"]),
        m("queue_length", "gauge", "Requests waiting for a slot.", stats["waiting"]),
        m("active_requests", "gauge", "Requests being prefilled or decoded.", stats["active"]),
        m("max_concurrent_requests", "gauge", "Slots: requests decoded together at most.", stats["max_concurrent"]),
        m("max_queue_length", "gauge", "Waiting places before requests are refused.", stats["max_waiting"]),
        m("requests_submitted_total", "counter", "Requests accepted.", stats["requests_submitted"]),
        Metric("requests_finished_total", "counter", "Requests ended, by how.",
               [({"reason": k}, v) for k, v in sorted(stats["finished"].items())]),
        Metric("requests_rejected_total", "counter", "Requests refused, by why.",
               [({"reason": k}, v) for k, v in sorted(stats["rejected"].items())]),
        m("decode_steps_total", "counter", "Batched decode steps run.", stats["decode_steps"]),
        m("decode_seconds_total", "counter", "Time in decode steps.", stats["decode_seconds"]),
        m("prefill_seconds_total", "counter", "Time in prefills.", stats["prefill_seconds"]),
        m("kv_cache_bytes", "gauge", "Bytes held by the running batch's KV cache.", stats["kv_cache_bytes"]),
        Metric.summary("time_to_first_token_seconds", "From submission (queue wait included) to the first token.",
                       stats["ttft_seconds_sum"], stats["ttft_count"]),
        Metric.summary("request_seconds", "From submission to the end of the request.",
                       stats["request_seconds_sum"], stats["request_count"]),
        m("model_info", "gauge", "The served model.", 1, model=model_name),
    ] + draft_metrics(stats.get("draft"))


def draft_metrics(draft: dict | None) -> list[Metric]:
    """The MTP head's drafting, when the server drafts (`--draft`)."""
    if not draft:
        return []
    m = Metric.one
    return [
        m("draft_passes_total", "counter", "Verify passes (decode steps that judged drafts).", draft["passes"]),
        m("draft_rounds_total", "counter", "Row rounds: one request's drafts judged by one pass.", draft["rounds"]),
        m("draft_tokens_total", "counter", "Draft tokens proposed.", draft["drafted"]),
        m("draft_accepted_tokens_total", "counter", "Draft tokens the model kept.", draft["accepted"]),
    ]


def engine_metrics(engine) -> list[Metric]:
    """Numeric `engine.stats` entries whose keys start with an `ENGINE_STAT_PREFIXES` prefix."""
    stats = getattr(engine, "stats", None) or {}
    out = []
    for key, value in sorted(stats.items()):
        if not key.startswith(ENGINE_STAT_PREFIXES) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        kind = "counter" if key.endswith("_total") else "gauge"
        out.append(Metric.one(_sanitize(key), kind, f"engine.stats[{key!r}]", value))
    return out


def render(metrics: Iterable[Metric]) -> str:
    lines = []
    seen = set()
    for metric in metrics:
        name = "strata_" + metric.name
        if name in seen:
            continue
        seen.add(name)
        lines.append(f"# HELP {name} {_escape_help(metric.help)}")
        lines.append(f"# TYPE {name} {metric.kind}")
        for i, (labels, value) in enumerate(metric.samples):
            sample = name + (metric.suffixes[i] if metric.suffixes else "")
            label_text = ",".join(f'{_sanitize(k)}="{_escape_label(str(v))}"' for k, v in labels.items())
            lines.append(f"{sample}{{{label_text}}} {_number(value)}" if label_text else f"{sample} {_number(value)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def _sanitize(name: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_]", "_", name)
    return name if not name[:1].isdigit() else "_" + name


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
