"""What a checkpoint is: its files, their sizes and a SHA-256 digest per chunk.

A manifest is committed after the data it describes, in every tier: a copy
whose manifest is missing is partial and never listed; one whose bytes do not
match the manifest's digests is corrupt and is repaired from another copy.
Digests are per :data:`CHUNK` so that a fetch verifies as it streams and a
repair can say which part of a file went bad.

Version 2 (this one) carries SHA-256 per chunk: a keeper accepts, serves and
a rank reads a copy only when its bytes match the manifest committed in the
catalog, and that must hold against someone who writes bytes on purpose. The
CRC32 of version 1 only catches accidents (4 bytes per chunk can be fixed up),
so a version-1 manifest (on disk, in a tier or in the catalog) is refused with
an error saying so: such a copy cannot be verified and is never read or
served; take a new checkpoint. SHA-256 rather than BLAKE2b: measured on this
box (x86 with SHA extensions, as every recent server CPU has), 1 GiB hashes in
0.52 s with SHA-256, 0.76 s with BLAKE2b and 0.15 s with CRC32 (``python -m
bench.checkpoint`` prints ``digest_s`` and ``crc32_s``); chunks of one file
are hashed on several threads (hashlib releases the GIL), and the keeper does
it after the rank's save returned, never the training loop.

A DCP checkpoint saved by several ranks is a *set*: each rank's files are an
ordinary checkpoint of the *part job* ``<job>=r<rank>`` (:func:`part_job`; ``=``
never occurs in a job's own name, so a part never collides with a job), kept by
its node's keeper like any other, and the set's manifest (job ``<job>``) holds
``.metadata`` and pins each part by the SHA-256 of its manifest (``parts``).
This module is where those names are made and read (:func:`part_job`, :func:`job_of`).

>>> m = Manifest.of_buffers("j1", 40, "node-a", {"state.phx": b"x" * 10})
>>> m.verify_file("state.phx", b"x" * 10)
>>> Manifest.parse(m.encode()).step
40
>>> part_job("j1", 3), job_of("j1=r3"), job_of("j1")
('j1=r3', 'j1', 'j1')
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CHUNK = 64 << 20  # bytes per digest
VERSION: Literal[2] = 2
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
MANIFEST_NAME = "MANIFEST.json"
METADATA = ".metadata"  # DCP's metadata file (a pickle: a keeper never reads it)
MAX_MANIFEST_BYTES = 4 << 20
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PART = re.compile(r"^([A-Za-z0-9_-]{1,64})=r(0|[1-9][0-9]{0,8})$")  # <job>=r<rank>, canonical
MAX_PARTS = 100_000  # ranks of one set (the manifest's byte bound allows ~30k with long names)
_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,128}(/[A-Za-z0-9_.-]{1,128}){0,4}$")
_HEX = r"^[0-9a-f]{64}$"

Kind = Literal["snapshot", "dcp"]


class ManifestError(ValueError):
    """A manifest that cannot be read, or data that does not match its manifest."""


def part_job(job: str, rank: int) -> str:
    """The name under which rank ``rank``'s files of a DCP checkpoint of ``job`` are kept."""
    if not _NAME.match(job):
        raise ValueError(f"{job!r} is not a job name (1-64 of letters, digits, '_', '-')")
    if type(rank) is not int or not 0 <= rank < 10**9:
        raise ValueError(f"rank must be an int in [0, 1e9), got {rank!r}")
    return f"{job}=r{rank}"


def job_of(name: str) -> str:
    """The job a part job (:func:`part_job`) belongs to; any other name itself."""
    m = _PART.match(name)
    return m.group(1) if m else name


def is_part(name: str) -> bool:
    return _PART.match(name) is not None


def digest(data: memoryview | bytes) -> str:
    """The SHA-256 of ``data``, hex."""
    return hashlib.sha256(data).hexdigest()


def digest_chunks(data: memoryview | bytes, chunk: int = CHUNK, threads: int = HASH_THREADS) -> list[str]:
    """SHA-256 (hex) of each ``chunk`` bytes of ``data`` (one entry for an empty file),
    the chunks hashed on up to ``threads`` threads."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return [digest(b"")]
    pieces = [view[i : i + chunk] for i in range(0, len(view), chunk)]
    if threads <= 1 or len(pieces) == 1:
        return [digest(p) for p in pieces]
    with ThreadPoolExecutor(max_workers=min(threads, len(pieces)), thread_name_prefix="digest") as pool:
        return list(pool.map(digest, pieces))


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    size: int = Field(ge=0)
    sha256: list[str] = Field(min_length=1)  # one per chunk, hex

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        if not all(isinstance(d, str) and re.match(_HEX, d) for d in v):
            raise ValueError("a digest is not 64 lowercase hex digits")
        return v

    @field_validator("name")
    @classmethod
    def _safe(cls, v: str) -> str:
        if not _FILE.match(v) or any(part in (".", "..") for part in v.split("/")):
            raise ValueError(f"unsafe file name {v!r} (letters, digits, '_.-', up to 5 levels)")
        if v == MANIFEST_NAME:
            raise ValueError(f"a file may not be named {MANIFEST_NAME}")
        return v


class Manifest(BaseModel):
    """One checkpoint: ``job`` at optimizer ``step``, taken on node ``origin``.

    ``kind`` is ``snapshot`` (one ``state.phx`` file, the buffer of
    :func:`phalanx.checkpoint.packing.pack`, whose layout is ``meta``) or ``dcp`` (the
    files ``torch.distributed.checkpoint`` wrote).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    version: Literal[2] = VERSION
    job: str
    step: int = Field(ge=0)
    kind: Kind
    origin: str
    created: float
    chunk: int = Field(default=CHUNK, gt=0)
    files: list[FileEntry] = Field(min_length=1, max_length=100_000)
    meta: bytes = b""
    parts: dict[str, str] = Field(default_factory=dict, max_length=MAX_PARTS)
    """A set (a DCP checkpoint of several ranks): part job -> SHA-256 (hex) of that
    part's manifest (:meth:`encode`) at this step; empty for any other checkpoint."""

    @field_validator("job")
    @classmethod
    def _job(cls, v: str) -> str:
        if not (_NAME.match(v) or _PART.match(v)):
            raise ValueError(
                f"{v!r} is not a job name (1-64 of letters, digits, '_', '-'; or a part <job>=r<rank>)"
            )
        return v

    @field_validator("origin")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r} is not a name (1-64 of letters, digits, '_', '-')")
        return v

    @model_validator(mode="after")
    def _parts(self) -> Manifest:
        if not self.parts:
            return self
        if self.kind != "dcp" or is_part(self.job):
            raise ValueError("only a DCP checkpoint of a job (not of a part) has parts")
        for name, sha in self.parts.items():
            if not is_part(name) or job_of(name) != self.job:
                raise ValueError(f"{name!r} is not a part of job {self.job!r}")
            if not isinstance(sha, str) or not re.match(_HEX, sha):
                raise ValueError(f"the digest of part {name!r} is not 64 lowercase hex digits")
        return self

    @field_validator("files")
    @classmethod
    def _consistent(cls, files: list[FileEntry], info: object) -> list[FileEntry]:
        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise ValueError("a file is listed twice")
        return files

    @classmethod
    def of_buffers(
        cls,
        job: str,
        step: int,
        origin: str,
        files: Mapping[str, memoryview | bytes],
        *,
        kind: Kind = "snapshot",
        meta: bytes = b"",
        chunk: int = CHUNK,
    ) -> Manifest:
        entries = [
            FileEntry(name=n, size=memoryview(d).nbytes, sha256=digest_chunks(d, chunk))
            for n, d in files.items()
        ]
        return cls(
            job=job,
            step=step,
            kind=kind,
            origin=origin,
            created=time.time(),
            chunk=chunk,
            files=entries,
            meta=meta,
        )

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise ManifestError(f"checkpoint {self.job}@{self.step} has no file {name!r}")

    def encode(self) -> bytes:
        """The canonical JSON (``parts`` left out when empty: a checkpoint that is not a set
        encodes as it did before sets existed)."""
        return self.model_dump_json(exclude={"parts"} if not self.parts else None).encode()

    @classmethod
    def parse(cls, raw: bytes, where: str = "manifest") -> Manifest:
        """The manifest in ``raw``; :class:`ManifestError` saying what is wrong otherwise."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(raw)} bytes, over {MAX_MANIFEST_BYTES}")
        _refuse_old(raw, where)
        try:
            m = cls.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            at = ".".join(str(p) for p in first["loc"]) or "the top level"
            raise ManifestError(f"{where}: not a valid manifest ({at}: {first['msg']})") from None
        for f in m.files:
            expected = max(1, -(-f.size // m.chunk))
            if len(f.sha256) != expected:
                raise ManifestError(
                    f"{where}: {f.name} has {len(f.sha256)} digests for {f.size} bytes in chunks of {m.chunk}"
                )
        return m

    def verify_file(self, name: str, data: memoryview | bytes) -> None:
        """Raise :class:`ManifestError` unless ``data`` is exactly file ``name``."""
        entry = self.file(name)
        size = memoryview(data).nbytes
        if size != entry.size:
            raise ManifestError(
                f"{self.job}@{self.step}/{name}: {size} bytes, the manifest says {entry.size}"
            )
        bad = bad_chunks(entry, data, self.chunk)
        if bad:
            raise ManifestError(
                f"{self.job}@{self.step}/{name}: digest mismatch in chunk(s) {bad[:8]} of {len(entry.sha256)}"
            )


def bad_chunks(entry: FileEntry, data: memoryview | bytes, chunk: int) -> list[int]:
    """Indexes of the chunks of ``data`` whose digest differs from ``entry``'s."""
    got = digest_chunks(data, chunk)
    return [i for i, (a, b) in enumerate(zip(got, entry.sha256, strict=False)) if a != b] + list(
        range(len(got), len(entry.sha256))
    )


def _refuse_old(raw: bytes, where: str) -> None:
    """A version-1 manifest (CRC32 checksums) is refused by name, not as a bad field."""
    try:
        version = json.loads(raw).get("version")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return  # not JSON (or not an object): the model's error says so
    if version == 1:
        raise ManifestError(
            f"{where}: a version-1 manifest (CRC32 checksums, which anyone can forge) cannot be"
            f" verified and is refused; this Phalanx reads version {VERSION} (SHA-256): take a new checkpoint"
        )


def newest(manifests: Iterable[Manifest]) -> Manifest | None:
    return max(manifests, key=lambda m: m.step, default=None)
