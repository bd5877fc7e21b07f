"""The import graph of the operator and the workers has no cycle: each module builds only on what comes before it."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"operator": "lockstep", "workers": "lockstep_workers"}


def modules() -> dict[str, Path]:
    found = {}
    for root, package in PACKAGES.items():
        for path in (REPO / root / package).rglob("*.py"):
            found[".".join(path.relative_to(REPO / root).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``path`` imports, lazy imports included; ``from package import module`` names only the
    module (the package's own ``__init__`` may import its modules)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            inner = [f"{node.module}.{alias.name}" for alias in node.names]
            modules_named = [name for name in inner if name in known]
            names |= set(modules_named) if len(modules_named) == len(inner) else {node.module, *modules_named}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names & set(known)


def test_no_module_imports_one_that_imports_it_back() -> None:
    known = modules()
    graph = {name: imported(path, known) - {name} for name, path in known.items()}
    assert "lockstep.crds" in graph and "lockstep_workers.agent" in graph
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as cycle:
        raise AssertionError(f"an import cycle: {' -> '.join(cycle.args[1])}") from None
    assert len(order) == len(graph)
