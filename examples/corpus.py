"""Builds the byte-level training corpus of the examples, offline.

    python -m examples.corpus [--out data/corpus.bin] [--max-bytes N]

The source is the standard library of the *running* interpreter: every ``*.py``
file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and
``dist-packages`` left out, symlinks not followed), in sorted order of their
relative paths, each preceded by a ``# ---- <relative path> ----`` line, the whole
cut at ``--max-bytes`` (default 8 MiB). Nothing is downloaded. The same Python
build (version and distribution packaging: some distributions split off or patch
parts of the stdlib) gives the same bytes on any machine.

The corpus is written atomically (temporary file, then rename), followed by a JSON
sidecar ``<out>.json`` (sha256, bytes, source count, Python version). Running it
again when the output and a matching sidecar exist does nothing. The file is a flat
``uint8`` token file for ``phalanx.runtime.data.TokenFile``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("data/corpus.bin")
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
FORMAT = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every ``*.py`` under ``root``, sorted by the relative path."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file() and not path.is_symlink():
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _records(files: list[tuple[str, Path]]) -> Iterator[bytes]:
    """Each file as one record: a header line, then its bytes ending with a newline."""
    for rel, path in files:
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data += b"\n"
        yield f"# ---- {rel} ----\n".encode() + data


def sidecar_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _python() -> str:
    return f"{platform.python_implementation()} {platform.python_version()}"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def existing(out: Path, max_bytes: int, source: str) -> dict[str, Any] | None:
    """The sidecar of ``out`` if it describes the file there and this request, else None."""
    try:
        meta = json.loads(sidecar_path(out).read_text())
        size = out.stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    wanted = {"format": FORMAT, "max_bytes": max_bytes, "python": _python(), "source": source, "bytes": size}
    if any(meta.get(k) != v for k, v in wanted.items()):
        return None
    return meta if meta.get("sha256") == _sha256(out) else None


def build_corpus(
    out: Path = DEFAULT_OUT, max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None
) -> dict[str, Any]:
    """Write the corpus to ``out`` unless it is already there; returns the sidecar
    plus ``built`` (whether this call wrote it). ``root`` replaces the stdlib as the
    source (for tests)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    out = Path(out)
    src = root or stdlib_root()
    source = "stdlib *.py" if root is None else f"{src} *.py"
    meta = existing(out, max_bytes, source)
    if meta is not None:
        return {**meta, "built": False}
    files = source_files(src)
    if not files:
        raise FileNotFoundError(f"no *.py files under {src}")
    buf = bytearray()
    sources = 0
    for record in _records(files):
        if len(buf) >= max_bytes:
            break
        sources += 1
        buf += record
    del buf[max_bytes:]
    data = bytes(buf)
    meta = {
        "format": FORMAT,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "sources": sources,
        "max_bytes": max_bytes,
        "python": _python(),
        "source": source,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out, data)
    _write_atomic(sidecar_path(out), (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    return {**meta, "built": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output file (default {DEFAULT_OUT})")
    ap.add_argument(
        "--max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="size cap in bytes (default 8 MiB)"
    )
    args = ap.parse_args(argv)
    meta = build_corpus(args.out, args.max_bytes)
    verb = "wrote" if meta["built"] else "up to date:"
    print(
        f"{verb} {args.out} ({meta['bytes']} bytes from {meta['sources']} files, sha256 {meta['sha256'][:16]}…)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
