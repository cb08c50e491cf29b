"""The package's layering (CONTRIBUTING.md, "The map and its layers"): every import points to the importer's own
layer or a lower one, and no two modules import each other, directly or around a circle.

Imports are read from the source (``ast``), lazy ones inside functions included: a circle closed by a lazy
import is still a circle a reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "pipefisher"

#: Top-level unit of the package (subpackage or module) -> its layer (CONTRIBUTING.md).
LAYERS: dict[str, int] = {
    "atomic": 0, "tracking": 0, "optim": 0, "data": 0, "model": 0, "timeline": 0, "hardware": 0, "conf": 0,
    "schedules": 1, "simulate": 1, "torch_schedule": 1,
    "profiling": 2, "config": 2, "run_folder": 2, "staleness_curve": 2, "run_spec": 2,
    "planning": 3, "evaluation": 3,
    "measure": 4, "runtime": 4,
    "launch": 5, "export": 5, "finetune": 5, "compare": 5, "cli": 5,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pipefisher"):
            candidates = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names if a.name.startswith("pipefisher")]
        else:
            continue
        found.update(c for c in candidates if c in known)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(path, mods) - {name} for name, path in mods.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_layer() -> None:
    units = {_unit(m) for m in _modules()} - {""}
    assert units <= LAYERS.keys(), f"give these a layer in CONTRIBUTING.md and here: {sorted(units - LAYERS.keys())}"


def test_no_import_points_to_a_higher_layer() -> None:
    wrong = sorted((m, t) for m, targets in _graph().items() for t in targets
                   if _unit(m) and _unit(t) and LAYERS[_unit(t)] > LAYERS[_unit(m)])
    assert not wrong, "imports from a higher layer:\n" + "\n".join(f"  {m} -> {t}" for m, t in wrong)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join("  " + " <-> ".join(c) for c in circles)
