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


WORKERS_LAYERS = {
    "agent": set(),
    "weights": {"agent"},
    "actor": {"agent", "weights"},
    "rollout": {"agent", "weights", "actor", "episodes"},
    "trainer": {"agent", "weights", "rollout", "episodes", "export"},
}
"""The workers' packages and what each may import of lockstep_workers outside itself, as each package's ``__init__``
says: one way, agent <- weights <- actor <- rollout <- trainer (the trainer never imports the actor: it reaches the
actors over HTTP and through the barrier)."""


def test_each_workers_package_imports_only_the_packages_below_it() -> None:
    known = modules()
    crossing = set()
    for name, path in known.items():
        package = name.split(".")[1] if name.count(".") >= 2 else None
        if package not in WORKERS_LAYERS:
            continue
        for target in imported(path, known):
            inside = target.removeprefix("lockstep_workers.")
            if target.startswith("lockstep_workers.") and inside.split(".")[0] != package:
                allowed = WORKERS_LAYERS[package]
                if inside not in allowed and inside.split(".")[0] not in allowed:
                    crossing.add(f"{name} imports {target}")
    assert set(WORKERS_LAYERS) <= {name.split(".")[1] for name in known if name.count(".") >= 2}
    assert not crossing, sorted(crossing)
