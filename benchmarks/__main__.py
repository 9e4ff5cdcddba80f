"""``python -m benchmarks`` lists the benchmarks and tools, one line each; ``python -m
benchmarks NAME [ARGS]`` runs one, as ``python -m benchmarks.NAME [ARGS]`` does (results in
``--results-dir``: ``benchmarks/results`` in a checkout, the current directory from an
installed package)."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import sys
from pathlib import Path

import benchmarks
from benchmarks import common

TOOLS = ("cost_table", "prediction_errors")  # read committed results, measure nothing


def runnable() -> list[str]:
    """The modules of ``benchmarks`` that run (those with a ``main``), read, not imported."""
    return sorted(name for name, tree in _modules().items()
                  if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body))


def _modules() -> dict[str, ast.Module]:
    return {m.name: ast.parse((Path(benchmarks.__path__[0]) / f"{m.name}.py").read_text())
            for m in pkgutil.iter_modules(benchmarks.__path__) if not m.name.startswith("_")}


def summary(name: str) -> str:
    """The first sentence of module ``name``'s docstring, less a closing parenthesis."""
    doc = ast.get_docstring(_modules()[name]) or ""
    first = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].rstrip(".")
    return re.sub(r" \([^()]*\)$", "", first)


def listing() -> list[str]:
    names = runnable()
    width = max(map(len, names))
    lines = ["python -m benchmarks NAME [ARGS] runs one (NAME --help: its options). Benchmarks:"]
    lines += [f"  {n:<{width}}  {summary(n)}" for n in names if n not in TOOLS]
    lines.append("Tools (from the committed results):")
    return lines + [f"  {n:<{width}}  {summary(n)}" for n in names if n in TOOLS]


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("\n".join(listing()))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in runnable():
        print(f"error: {name!r} is not a benchmark; choose one of {runnable()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name}")
    common.run(lambda: module.main(rest))  # ends the process, as the module's own __main__
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
