"""The documentation lives in this repository, and what it names exists.

Comments once sent readers to a design brief and measurement notes kept outside the
repository. These tests fail on any such reference in code, tests, docs or the
README, on a ``docs/<name>.md`` or a repository path the README and docs/ name that
does not exist, and on a package of ``libs/phalanx`` missing from the layout lists
(README's "How the code is laid out", docs/architecture.md's table) or one listed
there that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED_DIRS = ("libs", "services", "tests", "bench", "examples", "deploy", "proto", "docs", ".ci", ".github")
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml", "constraints.txt")
SKIPPED_DIRS = {
    "__pycache__",
    ".venv",
    ".phalanx",
    "node_modules",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
}
MAX_BYTES = 2 << 20

# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join(
        (
            re.escape("DESIGN" + ".md"),
            re.escape(".." + "/shared"),
            re.escape("shared" + "/notes"),
            r"(?<![\w/.-])notes" + r"/[\w.-]+\.md",
            "notes" + r" \u00a7",
        )
    )
)
DOC_REF = re.compile(r"(?<![\w./-])docs/([\w.-]+\.md)")
RELATIVE_LINK = re.compile(r"\]\(([\w.-]+\.md)(?:#[\w-]*)?\)")
PACKAGE_NAME = re.compile(r"`phalanx\.([a-z_]+)")
REPO_PATH = re.compile(r"`((?:libs|services|tests|bench|examples|deploy|proto|docs)/[\w./-]+)`")


def text_files(root: Path) -> list[Path]:
    """The text files a reader may follow a reference from (binary and huge files skipped)."""
    found = [root / f for f in SCANNED_FILES if (root / f).is_file()]
    for d in SCANNED_DIRS:
        base = root / d
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            if p.is_file() and not SKIPPED_DIRS.intersection(p.relative_to(root).parts):
                found.append(p)
    return [p for p in found if p.stat().st_size <= MAX_BYTES and b"\0" not in p.read_bytes()[:8192]]


def outside_references(root: Path) -> list[str]:
    """``path:line: text`` of every reference to documents outside the repository."""
    out = []
    for p in text_files(root):
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                out.append(f"{p.relative_to(root)}:{n}: {line.strip()}")
    return out


def missing_docs(root: Path) -> list[str]:
    """``path:line: docs/<name>.md`` for every ``docs/<name>.md`` named (or linked from docs/) that is absent."""
    out = []
    for p in text_files(root):
        in_docs = p.parent == root / "docs"
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            names = DOC_REF.findall(line) + (RELATIVE_LINK.findall(line) if in_docs else [])
            out += [
                f"{p.relative_to(root)}:{n}: docs/{x}" for x in names if not (root / "docs" / x).is_file()
            ]
    return out


def missing_paths(root: Path) -> list[str]:
    """``path:line: x`` for every repository path the README or docs/ name (in backticks) that is absent."""
    out = []
    for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            out += [
                f"{p.relative_to(root)}:{n}: {x}" for x in REPO_PATH.findall(line) if not (root / x).exists()
            ]
    return out


def packages(root: Path) -> set[str]:
    """The packages and top-level modules of ``libs/phalanx``, and ``services``."""
    lib = root / "libs" / "phalanx"
    names = {p.name for p in lib.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    names |= {p.stem for p in lib.glob("*.py") if not p.stem.startswith("_")}
    return names | {"services"}


def section(text: str, heading: str) -> str:
    """The body of the markdown section ``heading`` (up to the next heading of any level)."""
    m = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert m, f"no section {heading!r}"
    return m.group(1)


def test_no_reference_leaves_the_repository() -> None:
    found = outside_references(ROOT)
    assert not found, "references to documents outside the repository:\n" + "\n".join(found)


def test_every_docs_file_named_exists() -> None:
    missing = missing_docs(ROOT)
    assert not missing, "named but not in docs/:\n" + "\n".join(missing)


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = missing_paths(ROOT)
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_layout_lists_every_package_and_only_real_ones(doc: str) -> None:
    listed = set(PACKAGE_NAME.findall(section((ROOT / doc).read_text(), "How the code is laid out")))
    real = packages(ROOT)
    assert real - listed == set(), f"{doc}: packages missing from the layout"
    assert listed - real == set(), f"{doc}: the layout names packages that do not exist"


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    docs = "docs" + "/"  # spelled in pieces, as above
    (tmp_path / "docs" / "here.md").write_text("[there](there" + ".md), [here](here" + ".md#a)\n")
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / "m.py").write_text(
        f'"""See {"DESIGN"}.md and {docs}here.md."""\n# {".."}/shared/x, {docs}gone.md\n'
    )
    (tmp_path / "README.md").write_text("measured in " + "notes" + "/inprocess-recovery.md\n")
    assert sorted(r.split(":")[0] for r in outside_references(tmp_path)) == [
        "README.md",
        "libs/m.py",
        "libs/m.py",
    ]
    (tmp_path / "README.md").write_text(
        (tmp_path / "README.md").read_text() + "`libs/m.py` and `tests/" + "gone.py`\n"
    )
    assert missing_paths(tmp_path) == ["README.md:2: tests/" + "gone.py"]
    assert sorted(missing_docs(tmp_path)) == [
        f"{docs}here.md:1: {docs}there.md",
        f"libs/m.py:2: {docs}gone.md",
    ]
