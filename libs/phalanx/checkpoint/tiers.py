"""The places a checkpoint can be, and how a copy is written, listed, read and removed.

Tiers, fastest first for a reader: ``memory`` (a keeper's shared memory: the
snapshot slot it holds, or a replica it received), ``disk`` (the node's local
file system), ``shared`` (a file-system path every node mounts) and ``object``
(an S3-compatible object store, through obstore). A copy is complete when its
manifest is there: :class:`DirTier` writes a copy into a hidden ``.partial-*``
directory and renames it into place after the manifest; :class:`ObjectTier`
puts the manifest object after every data object and deletes it first. A copy
without a manifest is never listed; one whose manifest is bad is reported and
skipped. A restore reads a copy with ``read_into``, straight into the buffer it
fills (an object in ranges of ``part_bytes``: never a whole object in RAM).

Both classes are blocking: the keeper calls them in worker threads.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import phalanx.checkpoint.paths as paths
from phalanx.checkpoint.manifest import MANIFEST_NAME, Manifest, ManifestError
from phalanx.telemetry import get_logger

log = get_logger(component="checkpoint-tiers")


class Tier(StrEnum):
    MEMORY = "memory"
    DISK = "disk"
    SHARED = "shared"
    OBJECT = "object"


DRAIN_ORDER = (Tier.DISK, Tier.SHARED, Tier.OBJECT)
ReadFile = Callable[[str], memoryview]  # a file of the checkpoint, by name
Pace = Callable[[int], None]  # called after each piece written, with its bytes (a Throttle's pace)


@dataclass(frozen=True)
class RetryPolicy:
    """How the keeper retries what failed (a tier's write, a catalog write): after
    ``first_s``, then ``factor`` times longer each time, at most ``max_s`` apart, at
    most ``attempts`` times (0: until it works).

    >>> [RetryPolicy(1, 2, 5).delay(a) for a in range(5)]
    [1.0, 2.0, 4.0, 5.0, 5.0]
    """

    first_s: float = 1.0
    factor: float = 2.0
    max_s: float = 300.0
    attempts: int = 0

    def delay(self, attempt: int) -> float:
        return float(min(self.max_s, self.first_s * self.factor ** min(attempt, 64)))

    def gives_up(self, attempt: int) -> bool:
        return bool(self.attempts) and attempt >= self.attempts


class Store(Protocol):
    """A durable tier: where the keeper drains to and reads back from."""

    tier: Tier
    location: str

    def put(self, manifest: Manifest, read: ReadFile, pace: Pace | None = None) -> None: ...
    def manifests(self, job: str) -> list[Manifest]: ...
    def read_into(self, manifest: Manifest, name: str, into: memoryview, at: int = 0) -> None: ...
    def delete(self, job: str, step: int) -> None: ...
    def damage(self, manifest: Manifest) -> list[str]: ...


def step_key(step: int) -> str:
    return f"{step:012d}"


def _chunks(view: memoryview, size: int = 16 << 20) -> Iterator[memoryview]:
    for i in range(0, len(view), size):
        yield view[i : i + size]


class DirTier:
    """Checkpoints as ``<root>/<job>/<step:012d>/{files..., MANIFEST.json}``."""

    def __init__(self, tier: Tier, root: Path, *, fsync: bool = True) -> None:
        self.tier, self.root, self.fsync = tier, Path(root), fsync
        self.location = str(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, job: str, step: int) -> Path:
        return self.root / job / step_key(step)

    def put(self, manifest: Manifest, read: ReadFile, pace: Pace | None = None) -> None:
        """Write a copy (``read`` gives each file's bytes), ``pace`` called after each piece."""
        job_dir = self.root / manifest.job
        job_dir.mkdir(parents=True, exist_ok=True)
        tmp = job_dir / f".partial-{step_key(manifest.step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for f in manifest.files:
                dst = tmp / f.name
                dst.parent.mkdir(parents=True, exist_ok=True)
                with open(dst, "wb") as out:
                    for piece in _chunks(read(f.name)):
                        out.write(piece)
                        if pace is not None:
                            pace(len(piece))
                    out.flush()
                    if self.fsync:
                        os.fsync(out.fileno())  # this file only: DCP's sync_files calls a machine-wide sync()
            self._write_manifest(tmp, manifest)
            final = self.path(manifest.job, manifest.step)
            if final.exists():  # a bad copy being repaired: out of the way first (its manifest goes first)
                self._remove(final)
            os.rename(tmp, final)
            if self.fsync:
                _fsync_dir(job_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write_manifest(self, where: Path, manifest: Manifest) -> None:
        with open(where / MANIFEST_NAME, "wb") as out:
            out.write(manifest.encode())
            out.flush()
            if self.fsync:
                os.fsync(out.fileno())

    def manifests(self, job: str) -> list[Manifest]:
        job_dir = self.root / job
        if not job_dir.is_dir():
            return []
        out = []
        for d in sorted(job_dir.iterdir()):
            if d.name.startswith(".") or not (d / MANIFEST_NAME).is_file():
                continue  # partial (being written or deleted)
            try:
                m = Manifest.parse((d / MANIFEST_NAME).read_bytes(), str(d / MANIFEST_NAME))
            except ManifestError as exc:
                log.warning("manifest_bad", tier=self.tier.value, path=str(d), error=str(exc))
                continue
            if m.job != job or step_key(m.step) != d.name:
                log.warning("manifest_misplaced", tier=self.tier.value, path=str(d), job=m.job, step=m.step)
                continue
            out.append(m)
        return out

    def jobs(self) -> list[str]:
        return sorted(d.name for d in self.root.iterdir() if d.is_dir()) if self.root.is_dir() else []

    def read(self, manifest: Manifest, name: str) -> memoryview:
        entry = manifest.file(name)
        path = self.path(manifest.job, manifest.step) / name
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.size:
                raise ManifestError(f"{path}: {size} bytes, the manifest says {entry.size}")
            if size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ))

    def read_into(self, manifest: Manifest, name: str, into: memoryview, at: int = 0) -> None:
        """Bytes ``at`` to ``at + len(into)`` of file ``name`` of this copy, into ``into``."""
        entry = manifest.file(name)
        path = self.path(manifest.job, manifest.step) / name
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry.size or at + len(into) > size:
                raise ManifestError(f"{path}: {size} bytes, the manifest says {entry.size}")
            done = 0
            while done < len(into):
                n = os.preadv(f.fileno(), [into[done:]], at + done)
                if n <= 0:
                    raise ManifestError(f"{path}: short read at {at + done}")
                done += n

    def damage(self, manifest: Manifest) -> list[str]:
        """Files of this copy that are missing, short or fail their checksums."""
        bad = []
        for f in manifest.files:
            try:
                manifest.verify_file(f.name, self.read(manifest, f.name))
            except (ManifestError, OSError):
                bad.append(f.name)
        return bad

    def delete(self, job: str, step: int) -> None:
        final = self.path(job, step)
        if final.exists():
            self._remove(final)

    def _remove(self, d: Path) -> None:
        gone = f".deleting-{d.name}-{uuid.uuid4().hex[:8]}"
        with paths.dir_at(self.root, d.parent.name) as job_fd:
            paths.rename_at(job_fd, d.name, gone)  # unlisted at once: no manifest under a visible name
            with contextlib.suppress(OSError):
                paths.rmtree_at(job_fd, gone)

    def clean_partials(self, job: str) -> int:
        """Remove what an interrupted write or delete left; returns how many."""
        job_dir = self.root / job
        n = 0
        if job_dir.is_dir():
            for d in job_dir.iterdir():
                if d.name.startswith((".partial-", ".deleting-")):
                    with contextlib.suppress(OSError):
                        paths.rmtree_at(self.root, job, d.name)
                    n += 1
        return n


def _paced(pieces: Iterator[memoryview], pace: Pace | None) -> Iterator[memoryview]:
    for piece in pieces:
        if pace is not None:
            pace(len(piece))  # before handing it over: the upload is what is paced
        yield piece


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ObjectTier:
    """Checkpoints as objects ``<prefix>/<job>/<step:012d>/<file>``, the manifest put last.

    ``url`` is ``s3://bucket[/prefix]``; credentials, region and endpoint come from
    the usual ``AWS_*`` variables (``AWS_ENDPOINT_URL`` for a non-AWS server), or
    ``endpoint``. :meth:`put` streams each file from where it lies (the keeper's
    memory copy) as a multipart upload of ``part_bytes`` parts, ``concurrency`` at
    once; :meth:`read_into` fetches each object once, in ranges of ``part_bytes``
    written straight into the destination (``bytes_read`` counts them).
    """

    tier = Tier.OBJECT

    def __init__(
        self, url: str, *, endpoint: str | None = None, part_bytes: int = 16 << 20, concurrency: int = 8
    ) -> None:
        from obstore.store import S3Store

        parsed = urlparse(url)
        if parsed.scheme not in ("s3", "s3a") or not parsed.netloc:
            raise ValueError(f"object storage URL must be s3://bucket[/prefix], got {url!r}")
        self.location = url
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        config: dict[str, Any] = {}
        if endpoint:
            config["endpoint"] = endpoint
        client: dict[str, Any] = {"allow_http": True} if endpoint and endpoint.startswith("http:") else {}
        self.store = S3Store.from_url(url, config=config or None, client_options=client or None)  # type: ignore[arg-type]
        self.part_bytes, self.concurrency = part_bytes, concurrency
        self.bytes_read = 0

    def _key(self, job: str, step: int, name: str) -> str:
        return f"{job}/{step_key(step)}/{name}"

    def put(self, manifest: Manifest, read: ReadFile, pace: Pace | None = None) -> None:
        """Each file, then the manifest (the copy is complete once it is there). A file
        larger than a part goes up in parts read from ``read``'s buffer as the upload
        asks for them (no copy of the whole file); ``pace`` after each part."""
        import obstore

        for f in manifest.files:
            data = read(f.name)
            obstore.put(
                self.store,
                self._key(manifest.job, manifest.step, f.name),
                _paced(_chunks(data, self.part_bytes), pace) if len(data) > self.part_bytes else bytes(data),
                chunk_size=self.part_bytes,
                max_concurrency=self.concurrency,
            )
        obstore.put(self.store, self._key(manifest.job, manifest.step, MANIFEST_NAME), manifest.encode())

    def _objects(self, prefix: str) -> list[str]:
        import obstore

        return [o["path"] for batch in obstore.list(self.store, prefix=prefix) for o in batch]

    def manifests(self, job: str) -> list[Manifest]:
        import obstore

        out = []
        for path in self._objects(f"{job}/"):
            if not path.endswith("/" + MANIFEST_NAME):
                continue
            raw = bytes(obstore.get(self.store, path).bytes())
            try:
                m = Manifest.parse(raw, f"{self.location}/{path}")
            except ManifestError as exc:
                log.warning("manifest_bad", tier="object", path=path, error=str(exc))
                continue
            if m.job == job and path == self._key(job, m.step, MANIFEST_NAME):
                out.append(m)
        return out

    def read_into(self, manifest: Manifest, name: str, into: memoryview, at: int = 0) -> None:
        """Bytes ``at`` to ``at + len(into)`` of object ``name`` of this copy, into
        ``into``, one ranged GET streamed in pieces: the object is never held whole in memory.
        The object's size is checked against the manifest first (on the read at 0)."""
        import obstore

        entry = manifest.file(name)
        key = self._key(manifest.job, manifest.step, name)
        if at == 0:
            size = int(obstore.head(self.store, key)["size"])
            if size != entry.size:
                raise ManifestError(
                    f"{self.location}/{key}: {size} bytes, the manifest says {entry.size}"
                    f"{' (truncated object)' if size < entry.size else ''}"
                )
        if at + len(into) > entry.size:
            raise ManifestError(f"{self.location}/{key}: a read past the manifest's {entry.size} bytes")
        # One ranged GET, streamed into place in pieces of about ``part_bytes``.
        got = 0
        if len(into):
            result = obstore.get(self.store, key, options={"range": (at, at + len(into))})
            for piece in result.stream(min_chunk_size=self.part_bytes):
                view = memoryview(piece)
                if got + len(view) > len(into):
                    raise ManifestError(f"{self.location}/{key}: a longer range than asked (object changed?)")
                into[got : got + len(view)] = view
                got += len(view)
                self.bytes_read += len(view)
        if got != len(into):
            raise ManifestError(f"{self.location}/{key}: short read at {at + got} (object changed?)")

    def read(self, manifest: Manifest, name: str) -> memoryview:
        """Object ``name`` whole, in a buffer of its own (:meth:`read_into` without one)."""
        into = memoryview(bytearray(manifest.file(name).size))
        self.read_into(manifest, name, into)
        return into

    def damage(self, manifest: Manifest) -> list[str]:
        bad = []
        for f in manifest.files:
            try:
                manifest.verify_file(f.name, self.read(manifest, f.name))
            except (ManifestError, OSError, FileNotFoundError):
                bad.append(f.name)
        return bad

    def delete(self, job: str, step: int) -> None:
        import obstore

        prefix = f"{job}/{step_key(step)}/"
        paths = self._objects(prefix)
        manifest = [p for p in paths if p.endswith("/" + MANIFEST_NAME)]
        if manifest:
            obstore.delete(self.store, manifest)  # unlisted first
        rest = [p for p in paths if p not in manifest]
        if rest:
            with contextlib.suppress(FileNotFoundError):
                obstore.delete(self.store, rest)
