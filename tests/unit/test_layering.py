"""The package layout is the architecture: floors, no import cycles, no torch under the launcher.

Every module of ``phalanx`` and ``phalanx.services`` is parsed (not imported) and each
``import`` (also those inside functions) becomes an edge. A package may import only from
its own floor or lower ones (README, "How the code is laid out"); modules must not import
each other in a cycle; the launcher, the worker agent, the contract and the services never
reach torch, not even lazily; and no class grows past 400 lines.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = (("phalanx", ROOT / "libs" / "phalanx"), ("phalanx.services", ROOT / "services"))

# A package's floor: it may import packages of its floor or below, never above.
FLOORS: dict[str, int] = {
    "phalanx": 0,  # the root __init__ (the version)
    "phalanx.contract": 0,
    "phalanx.lifecycle": 0,
    "phalanx.limits": 0,
    "phalanx.tracesummary": 0,
    "phalanx.batchplan": 1,
    "phalanx.settings": 1,
    "phalanx.telemetry": 2,
    "phalanx.bus": 3,
    "phalanx.metrics": 4,
    "phalanx.service": 4,
    "phalanx.checkpoint": 5,
    "phalanx.worker": 6,
    "phalanx.launcher": 7,
    "phalanx.runtime": 7,
    "phalanx.policy": 8,
    "phalanx.cluster": 8,
    "phalanx.jobstatus": 8,
    "phalanx.report": 8,
    "phalanx.natsauth": 8,
    "phalanx.services": 9,
    "phalanx.devstack": 10,
    "phalanx.cli": 11,
}
# Packages whose modules must never import torch, directly or through another phalanx module.
NO_TORCH = (
    "phalanx.contract",
    "phalanx.worker",
    "phalanx.launcher",
    "phalanx.cli",
    "phalanx.services.failure_detector",
    "phalanx.services.elasticity_planner",
    "phalanx.services.scheduler_signal",
)
MAX_CLASS_LINES = 400


@dataclass(frozen=True)
class Module:
    name: str
    path: Path


def modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for package, root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            found[name] = Module(name, path)
    return found


def imports(module: Module, known: dict[str, Module]) -> Iterator[str]:
    """Every module ``module`` imports (at any depth of its code), as absolute names."""
    is_package = module.path.name == "__init__.py"
    for node in ast.walk(ast.parse(module.path.read_text(), str(module.path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            yield target
            for alias in node.names:  # `from phalanx.contract import proto` imports a module
                if f"{target}.{alias.name}" in known:
                    yield f"{target}.{alias.name}"


def graph() -> tuple[dict[str, Module], dict[str, set[str]]]:
    known = modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for name, module in known.items():
        for target in imports(module, known):
            edges[name].add(target)
    return known, edges


def package_of(name: str) -> str:
    """The entry of FLOORS a module belongs to (its longest matching prefix)."""
    best = ""
    for package in FLOORS:
        if (name == package or name.startswith(package + ".")) and len(package) > len(best):
            best = package
    assert best, f"{name} is in no package of FLOORS: add it to the layout (README) and here"
    return best


def cycles(known: dict[str, Module], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in known:
        if root in index:
            continue
        work = [(root, iter(sorted(t for t in edges[root] if t in known)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(t for t in edges[child] if t in known))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    known, edges = graph()
    found = cycles(known, edges)
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle() -> None:
    known = {n: Module(n, Path(n)) for n in ("a", "b", "c", "d")}
    edges: dict[str, set[str]] = defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycles(known, edges) == [["a", "b", "c"]]


def test_no_package_imports_a_higher_floor() -> None:
    known, edges = graph()
    upward = sorted(
        f"{source} -> {target} (floor {FLOORS[package_of(source)]} -> {FLOORS[package_of(target)]})"
        for source, targets in edges.items()
        for target in targets
        if target in known and FLOORS[package_of(target)] > FLOORS[package_of(source)]
    )
    assert not upward, "imports of a higher floor:\n" + "\n".join(upward)


def test_the_contract_depends_on_nothing_of_phalanx() -> None:
    known, edges = graph()
    outside = sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        if package_of(source) == "phalanx.contract"
        for target in targets
        if target in known and package_of(target) not in ("phalanx.contract", "phalanx")
    )
    assert not outside, "the contract imports:\n" + "\n".join(outside)


def test_no_torch_under_the_launcher_worker_contract_services_and_cli() -> None:
    known, edges = graph()
    reaches: list[str] = []
    for start in known:
        if not start.startswith(NO_TORCH):
            continue
        seen, todo = {start}, [start]
        while todo:
            node = todo.pop()
            for target in edges[node]:
                if target == "torch" or target.startswith("torch."):
                    reaches.append(f"{start} reaches torch through {node}")
                elif target in known and target not in seen:
                    seen.add(target)
                    todo.append(target)
    assert not reaches, "\n".join(sorted(set(reaches)))


def test_no_class_over_400_lines() -> None:
    big = []
    for module in modules().values():
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    big.append(f"{module.name}.{node.name}: {lines} lines")
    assert not big, "classes over 400 lines:\n" + "\n".join(big)
