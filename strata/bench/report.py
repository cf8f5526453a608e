"""Write a bench result as JSON, a Markdown table and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path


def _f(x, nd=1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _hit(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def markdown(r: dict) -> str:
    m, s = r["machine"], r["serial_warm"]
    lines = [f"# strata bench: {Path(r['model']).name}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, GPU: "
             f"{m['gpu']['name'] if m['gpu'] else 'none'}; torch {m['torch']}, {m['torch_threads']} threads.",
             f"Flags: `{' '.join(r['flags'])}`", "",
             "| regime | method | tokens/s | spread / detail | expert hit rate |", "|---|---|---|---|---|"]
    for c in r["cold_start"]:
        lines.append(f"| cold start | fresh process to first token, page cache {c['page_cache']} | "
                     f"{_f(c['first_token_s'], 2)} s to first token | load {_f(c['load_s'], 2)} s | n/a |")
    lines.append(f"| serial warm | {s['runs']} runs, greedy, {s['tokens']} tokens (the report's method) | "
                 f"{_f(s['median_tps'])} median | {_f(s['min_tps'])} – {_f(s['max_tps'])} | {_hit(s['hit_rate'])} |")
    for c in r["concurrency"]:
        lines.append(f"| concurrency {c['concurrency']} | simultaneous greedy requests, continuous batching | "
                     f"{_f(c['aggregate_tps'])} aggregate, {_f(c['per_request_tps'])} per request | "
                     f"TTFT p50 {_f(c['ttft_p50_s'], 2)} s, p95 {_f(c['ttft_p95_s'], 2)} s | {_hit(c['hit_rate'])} |")
    lo = r["long_output"]
    w = lo["tps_per_window"]
    lines.append(f"| long output | {lo['tokens']} tokens greedy, per {lo['window']}-token window | "
                 f"{_f(w[0]) if w else 'n/a'} first → {_f(w[-1]) if w else 'n/a'} last window | "
                 f"{', '.join(_f(x) for x in w)} | {_hit(lo['hit_rate'])} |")
    for p in r["prefill"]:
        if "skipped" in p:
            lines.append(f"| prefill {p['tokens']} | chunked prefill | skipped | {p['skipped']} | n/a |")
        else:
            lines.append(f"| prefill {p['tokens']} | chunked prefill | {_f(p['tps'])} | | {_hit(p['hit_rate'])} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    conc = r["concurrency"]
    ax[0].plot([c["concurrency"] for c in conc], [c["aggregate_tps"] for c in conc], "o-", label="aggregate")
    ax[0].plot([c["concurrency"] for c in conc], [c["per_request_tps"] for c in conc], "s-", label="per request")
    ax[0].set(xlabel="concurrent requests", ylabel="tokens/s", title="Concurrency")
    ax[0].legend()
    w = r["long_output"]["tps_per_window"]
    ax[1].plot([(i + 1) * r["long_output"]["window"] for i in range(len(w))], w, "o-")
    ax[1].set(xlabel="tokens generated", ylabel="tokens/s", title="Long output")
    fig.tight_layout()
    paths.append(out / "bench.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def write(r: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(r, indent=2))
    (out / "bench.md").write_text(markdown(r))
    return [out / "bench.json", out / "bench.md", *plot(r, out)]
