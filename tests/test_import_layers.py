"""Layers import only downward, and no import (at the top or inside a function) closes a cycle.

quant -> gguf/formats (weights and their types) -> kernels -> models -> tiers -> runtime ->
serve/bench/cli. Every `import` and `from ... import` of a strata module in strata/ is read with
`ast`, so a function-level import cannot hide an upward edge or a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "strata"

# lowest first; a module takes the layer of its longest matching prefix
LAYERS = {
    "strata.errors": 0, "strata.argparser": 0, "strata.madvise": 0,  # leaves: imported by every layer
    "strata.quant": 1,
    "strata.gguf": 2, "strata.formats": 2,
    "strata.kernels": 3,
    "strata.models": 4,
    "strata.tiers": 5,
    "strata.runtime": 6, "strata.loader": 6,
    "strata.serve": 7, "strata.bench": 7, "strata.cli": 7, "strata.inspect": 7, "strata.synth": 7,
    "strata.demo": 7,
    "strata": 7,  # the package itself: `strata.load`, the public entry
}
TOP = 7


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer(module: str) -> int:
    if module.rsplit(".", 1)[-1].endswith("cli"):  # a command's entry point: the top layer
        return TOP
    prefix = module
    while prefix not in LAYERS:
        prefix = prefix.rsplit(".", 1)[0]
    return LAYERS[prefix]


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported strata module, line) for every import in the file, at any depth."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("strata")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if not base.startswith("strata"):
                continue
            for a in node.names:  # `from strata import kernels` imports the module strata.kernels
                found.append((f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, node.lineno))
    return [(m, line) for m, line in found if m in known and m != module]


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_import_points_down_or_sideways():
    upward = [f"{m}:{line} imports {target} (layer {layer(m)} -> {layer(target)})"
              for m, edges in graph().items() for target, line in edges if layer(target) > layer(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = {m: sorted({t for t, _ in e}) for m, e in graph().items()}
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_rule_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: an upward import inside a function, and a relative one, are both found."""
    pkg = tmp_path / "strata" / "models"
    pkg.mkdir(parents=True)
    src = pkg / "x.py"
    src.write_text("def f():\n    from strata.tiers import runtime\n    from . import y\n")
    known = {"strata.models.x", "strata.models.y", "strata.tiers", "strata.tiers.runtime"}
    found = imports("strata.models.x", src, known)
    assert ("strata.tiers.runtime", 2) in found and ("strata.models.y", 3) in found
    assert layer("strata.tiers.runtime") > layer("strata.models.x")
    assert layer("strata.tiers.plan_cli") == TOP and layer("strata.kernels.gpu") == 3


@pytest.mark.parametrize("module", ["strata.kernels", "strata.kernels.gpu", "strata.formats.weights"])
def test_kernels_and_weight_types_import_no_model_code(module):
    mods = graph()
    assert not [t for t, _ in mods[module] if layer(t) >= layer("strata.models")]
