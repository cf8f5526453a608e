"""`strata plan`: where every tensor would live, printed before anything is loaded."""

from __future__ import annotations

import argparse
import json

from strata.argparser import ArgumentParser
from strata.tiers.auto import auto_options, predict_hit_rate
from strata.tiers.expert_parallel.cli import add_parallel_args
from strata.tiers.options import TierOptions, add_tier_args, tier_options
from strata.tiers.plan import Plan, make_plan, summary
from strata.tiers.sizes import format_size


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="strata plan", description="Show the placement plan for a model.")
    p.add_argument("--model", "-m", required=True, help="a .gguf file or a Hugging Face directory")
    p.add_argument("--tensors", action="store_true", help="list every tensor with its home")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--auto", action="store_true",
                   help="detect RAM, device memory and disk, and choose the placement flags")
    p.add_argument("--trace", metavar="TRACE", help="predict the cache hit rate by replaying this routing trace")
    p.add_argument("--ctx-size", type=int, default=0, help="context the device's KV reserve is sized for "
                   "(default: the model's)")
    add_tier_args(p)
    add_parallel_args(p, plan=True)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from strata.formats.checkpoint import open_config

    _, config, source, _ = open_config(args.model)
    opts = TierOptions(**tier_options(args))
    detected = None
    if args.auto:
        opts, detected = auto_options(source, opts, args.model)
    parallel = _parallel(args, source, config, opts)
    if parallel:  # each rank's own plan; the whole model need not fit one of them
        print(json.dumps({"expert_parallel": parallel[1]}) if args.json else "\n".join(parallel[0]))
        return 0
    plan = make_plan(source, config, opts, ctx_size=args.ctx_size or None)
    prediction = predict_hit_rate(args.trace, plan, opts.cache_policy) if args.trace else None
    if args.json:
        print(json.dumps({**summary(plan), "auto": detected, "prediction": prediction}))
        return 0
    if detected:
        print(describe_auto(detected, opts))
    print(describe(plan, str(args.model)))
    if prediction:
        p = prediction
        print(f"  predicted hit rate {p['hit_rate']:.1%} ({p['policy']}; Belady's MIN {p['min_hit_rate']:.1%}) "
              f"at {p['fraction']:.0%} of experts cached, replaying {p['tokens']} traced routing decisions")
    if args.tensors:
        for name, tier in plan.homes.items():
            print(f"  {tier:<5} {format_size(plan.sizes[name]):>12}  {name}")
    return 0


def _parallel(args, source, config, opts):
    """--expert-parallel --world-size N: each rank's share (its own plan), or None."""
    if not args.expert_parallel:
        return None
    from strata.errors import BadOption
    from strata.tiers.expert_parallel.cli import plan_lines

    if args.world_size is None:
        raise BadOption("--expert-parallel needs --world-size N (the ranks to plan for)")
    return plan_lines(source, config, opts, args.world_size, args.ep_trace)


def describe_auto(d: dict, opts) -> str:
    return "\n".join([
        f"detected: {d['device']} (budget {format_size(d['device_budget'])}), RAM budget "
        f"{format_size(d['ram_budget'])}, free disk {format_size(d['free_disk'])}",
        f"  --pin-experts {opts.pin_experts}: {d['pin_experts_reason']}",
        f"chosen: --gpu-layers {opts.gpu_layers} --experts-cache {opts.experts_cache} "
        f"--pin-experts {opts.pin_experts} --cpu-threads {d['cpu_threads']}", ""])


def describe(plan: Plan, model: str) -> str:
    s = summary(plan)
    tb = s["tier_bytes"]
    lines = [f"plan for {model}",
             f"  device  {plan.device}, budget {format_size(plan.device_budget)}; "
             f"RAM budget {format_size(plan.ram_budget)}", "",
             f"  {'tier':<5} {'bytes':>12}  holds",
             f"  {'gpu':<5} {format_size(tb['gpu']):>12}  non-expert weights of {plan.gpu_layers}/{plan.n_layers} "
             f"blocks ({format_size(plan.dense_bytes('gpu'))}) + expert cache ({format_size(plan.cache_bytes)})"
             + (f" + pinned experts ({format_size(plan.expert_bytes('gpu'))})" if plan.expert_bytes("gpu") else ""),
             f"  {'ram':<5} {format_size(tb['ram']):>12}  other weights ({format_size(plan.dense_bytes('ram'))})"
             f" + experts ({format_size(plan.expert_bytes('ram'))})"
             + (f" + disk experts' RAM cache ({format_size(plan.ram_cache)})" if plan.ram_cache else ""),
             f"  {'disk':<5} {format_size(tb['disk']):>12}  experts read on demand from the file", ""]
    if plan.memory is not None:
        m = plan.memory
        lines += [f"  RAM budget {format_size(m.budget)}: {m.describe()}",
                  f"  context {m.ctx_size}" + (" (the longest that fits the budget; --ctx-size sets it)"
                                               if m.ctx_chosen else " (--ctx-size)"), ""]
    lines += _reserve_lines(plan)
    lines += _dense_form_lines(plan)
    lines += _expert_lines(plan, s)
    lines += [f"  override {pat}={tier}: {n} tensors" for pat, tier, n in plan.overrides]
    return "\n".join(lines)


def _reserve_lines(plan: Plan) -> list[str]:
    """The device's reserve, one line each, before the expert cache takes the rest."""
    r = plan.device_reserve
    if not r:
        return []
    note = "" if plan.reserve_applies else " (not taken from the budget: the simulated device is RAM)"
    return [f"  device reserve {format_size(sum(r.values()))}{note}",
            f"    kv cache     {format_size(r['kv']):>12}  at --ctx-size {plan.ctx_size}",
            f"    recurrent    {format_size(r['recurrent']):>12}  DeltaNet state and conv windows",
            f"    activations  {format_size(r['activations']):>12}  one prefill chunk's widest layer",
            f"    scratch      {format_size(r['scratch']):>12}  allocator, cuBLAS workspace, kernel tables", ""]


def _dense_form_lines(plan: Plan) -> list[str]:
    """How the device holds its dense quantized weights (`device_budget.dense_forms`)."""
    forms = list(plan.dense_forms.values())
    if not forms:
        return []
    blocks = forms.count("blocks")
    floats = {f for f in forms if f != "blocks"}
    line = f"  dense quantized weights on the device: {blocks} multiplied from their blocks (Triton)"
    if len(forms) > blocks:
        line += (f", {len(forms) - blocks} dequantized once at placement to {'/'.join(sorted(floats))} "
                 f"(+{format_size(plan.dense_extra)})")
    return [line + ("" if plan.device_is_cuda else " (on a CUDA device; the simulated one runs the CPU's)"), ""]


def _expert_lines(plan: Plan, s: dict) -> list[str]:
    if not plan.experts:
        return ["  no routed experts: the model is dense"]
    n = plan.n_experts
    cached = plan.slots / max(n - sum(x.n_experts for x in plan.experts if x.home == "gpu"), 1)
    return [f"  experts  {n} in {len(plan.experts)} layers, {format_size(plan.expert_bytes())} in all",
            f"  bytes per expert {format_size(plan.slot_bytes)} (gate + up + down); "
            f"{s['experts_per_gib']} experts per GiB",
            f"  expert cache {plan.slots} slots = {format_size(plan.cache_bytes)} ({cached:.0%} of experts)"
            + (f", {plan.prefill_reserve} kept for prefill" if plan.prefill_reserve else "")]
