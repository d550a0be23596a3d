"""What a checkpoint is: its files, their sizes and CRC32 checksums per chunk.

A manifest is committed after the data it describes, in every tier: a copy
whose manifest is missing is partial and never listed; one whose bytes do not
match the manifest's checksums is corrupt and is repaired from another copy.
Checksums are per :data:`CHUNK` so that a fetch verifies as it streams and a
repair can say which part of a file went bad.

>>> m = Manifest.of_buffers("j1", 40, "node-a", {"state.phx": b"x" * 10})
>>> m.verify_file("state.phx", b"x" * 10)
>>> Manifest.parse(m.encode()).step
40
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Iterable, Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

CHUNK = 64 << 20  # bytes per checksum
MANIFEST_NAME = "MANIFEST.json"
MAX_MANIFEST_BYTES = 4 << 20
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,128}(/[A-Za-z0-9_.-]{1,128}){0,4}$")

Kind = Literal["snapshot", "dcp"]


class ManifestError(ValueError):
    """A manifest that cannot be read, or data that does not match its manifest."""


def crc_chunks(data: memoryview | bytes, chunk: int = CHUNK) -> list[int]:
    """CRC32 of each ``chunk`` bytes of ``data`` (one entry for an empty file)."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        return [0]
    return [zlib.crc32(view[i : i + chunk]) for i in range(0, len(view), chunk)]


class FileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    size: int = Field(ge=0)
    crc32: list[int] = Field(min_length=1)  # one per chunk

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
    :func:`phalanx.runtime.state.pack`, whose layout is ``meta``) or ``dcp`` (the
    files ``torch.distributed.checkpoint`` wrote).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    version: Literal[1] = 1
    job: str
    step: int = Field(ge=0)
    kind: Kind
    origin: str
    created: float
    chunk: int = Field(default=CHUNK, gt=0)
    files: list[FileEntry] = Field(min_length=1, max_length=100_000)
    meta: bytes = b""

    @field_validator("job", "origin")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"{v!r} is not a name (1-64 of letters, digits, '_', '-')")
        return v

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
            FileEntry(name=n, size=memoryview(d).nbytes, crc32=crc_chunks(d, chunk)) for n, d in files.items()
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
        return self.model_dump_json().encode()

    @classmethod
    def parse(cls, raw: bytes, where: str = "manifest") -> Manifest:
        """The manifest in ``raw``; :class:`ManifestError` saying what is wrong otherwise."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{where}: {len(raw)} bytes, over {MAX_MANIFEST_BYTES}")
        try:
            m = cls.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            at = ".".join(str(p) for p in first["loc"]) or "the top level"
            raise ManifestError(f"{where}: not a valid manifest ({at}: {first['msg']})") from None
        for f in m.files:
            expected = max(1, -(-f.size // m.chunk))
            if len(f.crc32) != expected:
                raise ManifestError(
                    f"{where}: {f.name} has {len(f.crc32)} checksums for {f.size} bytes in chunks of {m.chunk}"
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
                f"{self.job}@{self.step}/{name}: checksum mismatch in chunk(s) {bad[:8]} of {len(entry.crc32)}"
            )


def bad_chunks(entry: FileEntry, data: memoryview | bytes, chunk: int) -> list[int]:
    """Indexes of the chunks of ``data`` whose CRC32 differs from ``entry``'s."""
    got = crc_chunks(data, chunk)
    return [i for i, (a, b) in enumerate(zip(got, entry.crc32, strict=False)) if a != b] + list(
        range(len(got), len(entry.crc32))
    )


def newest(manifests: Iterable[Manifest]) -> Manifest | None:
    return max(manifests, key=lambda m: m.step, default=None)
