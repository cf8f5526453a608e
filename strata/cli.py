"""One entry point; each subcommand lives in its module's `main(argv)`."""

from __future__ import annotations

import importlib
import sys

from strata.errors import StrataError

COMMANDS = {
    "run": ("strata.runtime.run_cli", "generate text from a prompt or chat interactively"),
    "inspect": ("strata.inspect", "describe a model file: tensors, quant types, experts"),
    "plan": ("strata.tiers.plan_cli", "show where every tensor would live, before loading"),
    "cache-sim": ("strata.tiers.cache_sim", "replay an expert trace under cache policies"),
    "serve": ("strata.serve.cli", "OpenAI-compatible HTTP server"),
    "bench": ("strata.bench.cli", "benchmark a model in four stated regimes"),
    "synth": ("strata.synth", "write a random-weight GGUF with a real model's shapes"),
}


def usage() -> str:
    lines = ["usage: strata COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "strata COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"strata: error: unknown command {name!r} (commands: {', '.join(COMMANDS)}; "
              "strata --help describes them)", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        print(f"strata: {name} is not available in this install ({e.name} is missing)", file=sys.stderr)
        return 2
    try:
        return module.main(rest) or 0
    except StrataError as e:
        one_line = " ".join(str(e).split())  # a message quoting file contents may hold newlines
        print(f"strata {name}: error: {one_line}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
