"""The house rules, read from the code itself: stages as folders, imports pointing down only, no import
circle, modules readable in one sitting, and the public names other tools import still there
(docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megamoe_convert"
ROOT = "megamoe_convert"

#: The small shared helpers: one stage of height 0, whose modules may import one another (no circle).
HELPERS = {"jsonio", "progress", "ui", "faults", "devices", "interrupts", "settings"}
#: Each stage's height: a module may import its own stage (no circle) or a lower one, never a higher one.
STAGES = {
    "errors": -1,  # the one error family, below everything
    "helpers": 0,  # HELPERS
    "source": 1,
    "layout": 2,  # the transform, its checks, scales, inverse, identity, placement and serving: pure functions
    "output": 3,
    "convert": 4, "synth": 4,
    "serve": 5,
    "hub": 6,  # pulls, pushes and byte ranges of a store on the hub, above the loading it plans for
    "engines": 7, "verify": 7,
    "cli": 8,
}
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _stage(module: str) -> str:
    if module == ROOT:
        return ROOT
    top = module.split(".")[1]
    return "helpers" if top in HELPERS else top


def _imports(module: str) -> set[str]:
    """Every ``megamoe_convert`` module ``module`` imports (at the top, in functions, for typing)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(ROOT + "."))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base != ROOT and not base.startswith(ROOT + "."):
                continue
            for alias in node.names:  # `from megamoe_convert.source import formats` names a module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    found.discard(module)
    return {m for m in found if m != ROOT}


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_module_has_a_stage() -> None:
    unknown = sorted(m for m in MODULES if m != ROOT and _stage(m) not in STAGES)
    assert not unknown, f"modules of no stage (add them to STAGES and docs/architecture.md): {unknown}"


def test_imports_point_down_only() -> None:
    upward = [f"{m} -> {t}" for m, targets in GRAPH.items() if m != ROOT for t in sorted(targets)
              if STAGES[_stage(t)] > STAGES[_stage(m)]
              or (STAGES[_stage(t)] == STAGES[_stage(m)] and _stage(t) != _stage(m))]
    assert not upward, "imports pointing up or sideways between stages:\n" + "\n".join(upward)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (``a -> b -> a``), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (circle := visit(t)):
                return circle
        state[m] = 2
        path.pop()
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_no_import_circle() -> None:
    circle = find_circle(GRAPH)
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_circle_check_finds_a_circle() -> None:
    """The checker itself: two modules importing each other are reported (so a pass means something)."""
    a, b = f"{ROOT}.source.checkpoint", f"{ROOT}.source.families"
    assert find_circle({**GRAPH, a: GRAPH[a] | {b}, b: GRAPH[b] | {a}}) is not None


def test_modules_are_readable_in_one_sitting() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules past {MAX_LINES} lines (split them by concern): {long}"


@pytest.mark.parametrize("dotted", [
    "megamoe_convert.load_rank", "megamoe_convert.load_slots", "megamoe_convert.transform_experts",
    "megamoe_convert.engines.vllm.install", "megamoe_convert.engines.sglang.install",
    "megamoe_convert.engines.vllm.plugin.register", "megamoe_convert.engines.sglang.plugin.register",
    "megamoe_convert.cli.main",
])
def test_public_names_import(dotted: str) -> None:
    module, _, name = dotted.rpartition(".")
    for submodule in MODULES:  # a submodule of the same name, imported first, never shadows the name
        if submodule.rpartition(".")[0] == module and submodule.rpartition(".")[2] == name:
            importlib.import_module(submodule)
    assert callable(getattr(importlib.import_module(module), name))
