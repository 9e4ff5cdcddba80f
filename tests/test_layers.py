"""The layers of the repository, read from the source with ``ast`` (imports at module level and
inside functions alike): the core ``sdpa_fusion`` imports neither ``schedules`` nor
``benchmarks``, ``schedules`` does not import ``benchmarks``, and inside ``sdpa_fusion`` and
inside ``schedules`` no module imports itself back through others.
Run: pytest -q tests/test_layers.py"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sdpa_fusion", "schedules", "benchmarks")
BELOW = {"sdpa_fusion": ("schedules", "benchmarks"), "schedules": ("benchmarks",)}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for package in PACKAGES
           for p in sorted((ROOT / package).rglob("*.py"))}


def _named(base: str, name: str) -> str:
    """``base.name`` when that is one of our modules, else ``base`` (a name defined in it)."""
    return f"{base}.{name}" if f"{base}.{name}" in MODULES else base


def imported(module: str) -> list[tuple[str, int]]:
    """(module, line) of every import of ``module``'s source: ``import a.b`` imports a.b,
    ``from a import b`` imports a.b when that is a module and a otherwise, relative imports
    resolved from ``module``'s package; ``from __future__`` imports nothing."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:  # from . (level 1: this package), from .. (its parent), ...
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{node.module}" if node.module else parent
            found += [(_named(base, alias.name), node.lineno) for alias in node.names]
    return found


def test_imports_are_resolved_to_our_modules():
    assert {"sdpa_fusion.kernels", "schedules.ring", "benchmarks.common"} <= set(MODULES)
    ring = {target for target, _ in imported("schedules.ring")}
    assert {"schedules.heads", "schedules.base", "schedules.runner", "torch"} <= ring
    assert "sdpa_fusion.merge" in {target for target, _ in imported("schedules.runner")}
    assert "schedules" in {target for target, _ in imported("schedules.plan")}  # from . import get
    assert "schedules.batch" in {t for t, _ in imported("schedules.integrations.transformers")}
    assert "sdpa_fusion.mask" in {t for t, _ in imported("sdpa_fusion.kernels.reference")}  # ..


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_layer_imports_nothing_above_it(package):
    upward = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
              for m in MODULES if m.split(".")[0] == package
              for target, line in imported(m)
              if target.split(".")[0] in BELOW[package]]
    assert upward == [], "\n".join(upward)


def edges(package: str) -> dict[str, list[str]]:
    """Module -> the modules of ``package`` it imports."""
    inside = [m for m in MODULES if m.split(".")[0] == package]
    return {m: sorted({t for t, _ in imported(m) if t in inside and t != m}) for m in inside}


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A path through ``graph`` that comes back to its start, or None."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(path: list[str]) -> list[str] | None:
        state[path[-1]] = "open"
        for t in graph[path[-1]]:
            if state.get(t) == "open":
                return path[path.index(t):] + [t]
            if t not in state and (found := visit(path + [t])):
                return found
        state[path[-1]] = "done"
        return None

    for m in graph:
        if m not in state and (found := visit([m])):
            return found
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["b"]}) == ["b", "c", "b"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


@pytest.mark.parametrize("package", ["sdpa_fusion", "schedules"])
def test_no_import_cycle_inside_a_package(package):
    found = find_cycle(edges(package))
    assert found is None, " -> ".join(found)
