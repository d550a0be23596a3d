"""``torch.distributed.checkpoint`` through the tiers: a StorageWriter and a StorageReader.

:class:`TieredWriter` is DCP's ``FileSystemWriter`` aimed at this node's shared
memory. Each rank writes its files into a directory of its own, a *part*
(``<shm_root>/<node>/dcp/<job>=r<rank>/<step:012d>/``), and hands it to its node's
keeper, which checksums it and replicates and drains it like any checkpoint (the part
job ``<job>=r<rank>``: :func:`phalanx.checkpoint.manifest.part_job`). When DCP
finishes, the coordinator writes ``.metadata`` into ``<node>/dcp/<job>/<step:012d>/``
and registers it as the *set*: its keeper commits it only if every rank's part is
committed at that step, their files cover every file ``.metadata`` refers to, and
it pins each part by the SHA-256 of its manifest. A checkpoint is thus one catalog
entry (``job@step``, the set) whose files are spread over the keepers of the nodes
that wrote them; a rank that died before its part was registered leaves no set, so
an incomplete save is never listed. Where another uid took the name ``dcp/<job>=r<rank>``
or ``dcp/<job>`` first (a directory of its own, a symlink), the rank refuses it, says
so, and writes in a fallback directory of its own beside it (:mod:`~.jobdirs`).

:class:`TieredReader` asks its node's keeper for the set and then for each part (the
keeper brings a part from a peer or a tier as it does any checkpoint), checks each
part's manifest against the digest the set pinned, and checks every file, in this
process, against the SHA-256 digests of its manifest (the one committed in the
catalog: the keeper serves no other). DCP then reads through a file system that
reads those verified files only (a name no part has is refused), so any node can
load the checkpoint, at any shard count (DCP reshards). DCP unpickles ``.metadata``
(and ``torch.load``-s byte items from the data files with ``weights_only=False``), so
a planted or altered file would run code in the rank: each file is opened once
(without following a symlink) and DCP reads it from the very descriptor its digest
was checked through -- a file swapped under its name after the check is never read --
and ``.metadata`` is unpickled from the very bytes that were checked. The rank trusts
its node's keeper (reached through a Unix socket in the keeper's own directory) for
which manifest is committed; it checks the bytes itself.

::

    import torch.distributed.checkpoint as dcp
    fut = dcp.async_save(state, storage_writer=TieredWriter("j1", step=100))
    ...
    dcp.load(state, storage_reader=TieredReader("j1"))        # the newest; or step=100

With ``step=None`` the reader takes the newest set whose every part can be had (an
older one when a part of the newest is lost everywhere); with a step, a missing part
is :class:`NoCheckpoint`. A checkpoint written before sets existed (every file in the
one directory, no parts) still reads. DCP must save with its collectives
(``use_collectives=True``, the default: one ``.metadata``). ``sync_files`` is off: the
keeper fsyncs what it drains to disk, file by file (DCP's ``sync_files=True`` calls a
machine-wide ``os.sync()``).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import weakref
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import phalanx.checkpoint.paths as paths
import phalanx.checkpoint.wire as wire
from phalanx.checkpoint.client import Checkpointer, Loaded, NoCheckpoint
from phalanx.checkpoint.jobdirs import JOB_DIR_MODE, own_job_dir
from phalanx.checkpoint.manifest import METADATA, Manifest, ManifestError, digest, part_job
from phalanx.checkpoint.tiers import step_key
from phalanx.telemetry import get_logger

__all__ = ["METADATA", "TieredReader", "TieredWriter", "verified"]
log = get_logger(component="checkpoint-dcp")


class TieredWriter(FileSystemWriter):
    """DCP's writer of checkpoint ``step`` of ``job``: this rank's files a part on its
    node's keeper, the coordinator's ``.metadata`` the set tying the parts (module doc)."""

    def __init__(
        self, job: str, step: int, *, checkpointer: Checkpointer | None = None, **kwargs: Any
    ) -> None:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.ckpt = checkpointer or Checkpointer(job)
        if self.ckpt.job != job:
            raise ValueError(f"the checkpointer is job {self.ckpt.job!r}'s, not {job!r}'s")
        self.step = step
        self.part = part_job(job, 0)  # set_up_storage_writer says which rank this is
        kwargs.setdefault("sync_files", False)
        super().__init__(self.ckpt.root / self.ckpt.node / "dcp" / job / step_key(step), **kwargs)

    def _step_dir(self, name: str) -> Path:
        """``<node>/dcp/<name>/<step>``, made: ``name`` a job (the set) or a part. The
        job's directory is this uid's own, never followed through a symlink: where
        another uid squatted its name, a fallback of its own (:mod:`~.jobdirs`); the
        step's directory in it is a real directory of this uid too. DCP then writes by
        path below it: no other uid can rename or replace an entry on that path (the
        node's directory is the keeper's, ``dcp/`` sticky, the rest this uid's)."""
        own = own_job_dir(self.ckpt.root / self.ckpt.node, "dcp", name)
        try:
            with paths.dir_at(own.fd, step_key(self.step), create=JOB_DIR_MODE) as fd:
                paths.check_owned(fd, os.geteuid(), str(own.path / step_key(self.step)))
        finally:
            os.close(own.fd)
        return own.path / step_key(self.step)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise ValueError(
                "TieredWriter saves with DCP's collectives (use_collectives=True): one .metadata"
            )
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.part = part_job(self.ckpt.job, int(rank))
        self.path = self._step_dir(self.part)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's write of this rank's files (synchronous: the future is done), then the
        part registered with this node's keeper (checksummed and committed) before DCP
        gathers the results: the set is registered after every part."""
        fut = super().write_data(plan, planner)
        if fut.wait():
            self._register(self.part, Path(self.path))
        else:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)  # nothing for this rank to save: no part
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator's: ``.metadata`` into the set's directory, registered with the
        parts of every rank that wrote a file (``results`` is indexed by rank)."""
        parts = [part_job(self.ckpt.job, rank) for rank, written in enumerate(results) if written]
        files = sorted({w.storage_data.relative_path for written in results for w in written})
        self.path = self._step_dir(self.ckpt.job)
        super().finish(metadata, results)
        self._register(self.ckpt.job, Path(self.path), parts=parts, files=files)

    def _register(self, name: str, directory: Path, **fields: Any) -> None:
        request = {"op": "register", "job": name, "step": self.step, "dir": str(directory), **fields}
        wire.call(self.ckpt.socket, request, self.ckpt.timeout_s)


class _VerifiedFiles(FileSystem):
    """The file system DCP reads a :class:`TieredReader`'s checkpoint through: each file
    is read from the descriptor it was verified through (name -> descriptor, this
    object's to close), so no path is opened again after its digest matched; any other
    name, or any write, is :class:`ManifestError`."""

    def __init__(self, files: Mapping[str, int]) -> None:
        super().__init__()
        self.files = dict(files)

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        if suffix not in self.files:
            raise ManifestError(f"{suffix!r} is no verified file of this checkpoint: not read")
        return suffix  # what create_stream is handed: the name of a verified file

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        fd = self.files.get(str(path)) if isinstance(path, str) else None
        if mode != "rb" or fd is None:
            raise ManifestError(f"{path} ({mode!r}) is no verified file of this checkpoint: not opened")
        with open(fd, "rb", closefd=False) as stream:  # the descriptor stays this object's
            stream.seek(0)
            yield stream

    def close(self) -> None:
        files, self.files = self.files, {}
        for fd in files.values():
            os.close(fd)


class TieredReader(FileSystemReader):
    """DCP's reader of checkpoint ``step`` (None: the newest whose every part can be
    had) of ``job``, every file verified first (:class:`ManifestError` if one does not
    match, or a part is not the one the set pinned: nothing was read);
    :class:`NoCheckpoint` when the checkpoint asked for (or any) cannot be had.

    Each file is opened once, without following a symlink, checked through that
    descriptor and read by DCP from it: a file swapped for another under its name after
    the check is never read. The reader holds a descriptor per file of the checkpoint
    until :meth:`close` (or until it is collected)."""

    def __init__(
        self, job: str, step: int | None = None, *, checkpointer: Checkpointer | None = None
    ) -> None:
        ckpt = checkpointer or Checkpointer(job)
        self.loaded, self.parts = _fetch(ckpt, step)
        m = self.loaded.manifest
        files = _paths(self.loaded)
        for part in self.parts.values():
            for name, path in _paths(part).items():
                if name in files or name == METADATA:
                    raise ManifestError(f"{m.job}@{m.step}: {name} is in two parts (or is a part's)")
                files[name] = path
        if METADATA not in files:
            raise ManifestError(f"checkpoint {m.job}@{m.step} has no {METADATA}: not a DCP checkpoint")
        fs = _VerifiedFiles(_open_all(files))
        try:
            self._metadata = verified(m, fs.files)
            for part in self.parts.values():
                verified(part.manifest, fs.files)
            os.close(fs.files.pop(METADATA))  # unpickled from the bytes checked, not read again
        except BaseException:
            fs.close()
            raise
        super().__init__(files[METADATA].parent)
        self.fs = fs
        weakref.finalize(self, fs.close)

    def close(self) -> None:
        """Close the verified files (DCP reads nothing more through this reader)."""
        assert isinstance(self.fs, _VerifiedFiles)
        self.fs.close()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata, unpickled from the bytes whose digest matched (one file, written
        by the coordinator: a per-rank ``__<rank>.metadata`` is not supported)."""
        if kwargs.get("rank") is not None:
            raise ValueError("TieredReader reads one .metadata, not one per rank")
        where = f"{self.loaded.manifest.job}@{self.loaded.step}"
        metadata = pickle.loads(self._metadata)  # these bytes matched the committed digest
        if not isinstance(metadata, Metadata):
            raise ManifestError(f"{METADATA} of {where} is not DCP metadata")
        assert isinstance(self.fs, _VerifiedFiles)
        named = {getattr(s, "relative_path", None) for s in (metadata.storage_data or {}).values()}
        missing = sorted(str(n) for n in named if n not in self.fs.files)
        if missing:
            raise ManifestError(f"{METADATA} of {where} refers to {missing[:8]}, which no part has")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _fetch(ckpt: Checkpointer, step: int | None) -> tuple[Loaded, dict[str, Loaded]]:
    """The set ``step`` (None: the newest whose parts can all be had) and its parts."""
    if step is not None:
        return _fetch_step(ckpt, step)
    listed = ckpt.list()
    if not listed:
        raise NoCheckpoint(f"job {ckpt.job!r} has no checkpoint")
    why = ""
    for info in listed:
        try:
            return _fetch_step(ckpt, info.step)
        except NoCheckpoint as exc:
            why = str(exc)
            log.warning("checkpoint_incomplete", job=ckpt.job, step=info.step, error=why[:1000])
    raise NoCheckpoint(f"no checkpoint of job {ckpt.job!r} can be read whole; the oldest: {why}")


def _fetch_step(ckpt: Checkpointer, step: int) -> tuple[Loaded, dict[str, Loaded]]:
    loaded = ckpt.fetch(step)
    m = loaded.manifest
    if m.kind != "dcp":
        raise ValueError(
            f"checkpoint {m.job}@{loaded.step} is a Phalanx snapshot, not a DCP checkpoint:"
            " read it with Checkpointer.load"
        )
    parts = {}
    for part, pinned in sorted(m.parts.items()):
        reader = Checkpointer(
            part, node=ckpt.node, worker=ckpt.worker, root=ckpt.root, timeout_s=ckpt.timeout_s
        )
        try:
            got = reader.fetch(loaded.step)
        except NoCheckpoint as exc:
            raise NoCheckpoint(f"{m.job}@{loaded.step}: part {part} cannot be had ({exc})") from None
        if digest(got.manifest.encode()) != pinned:
            raise ManifestError(
                f"{m.job}@{loaded.step}: part {part} is not the one the set pinned (its manifest's"
                " digest differs: re-registered or replaced after the set): refused"
            )
        parts[part] = got
    return loaded, parts


def _paths(loaded: Loaded) -> dict[str, Path]:
    """Name -> file of a fetched DCP copy (a directory of whole files)."""
    out = {}
    for name, (path, offset) in loaded.files.items():
        if offset:
            raise ManifestError(f"{loaded.manifest.job}@{loaded.step}/{name}: not a whole file")
        out[name] = Path(path)
    return out


def _open_all(files: Mapping[str, Path]) -> dict[str, int]:
    """Name -> descriptor of each file (the file itself not followed if it is a symlink,
    and a regular file only); all or none."""
    out: dict[str, int] = {}
    try:
        for name, path in files.items():
            with paths.dir_at(path.parent) as dir_fd:
                out[name] = paths.open_file(dir_fd, path.name, os.O_RDONLY)
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def verified(m: Manifest, files: Mapping[str, int]) -> bytes:
    """Check every file of ``m`` (the open file ``files[name]``, read from the
    descriptor DCP will read) against its digests; the bytes of ``.metadata`` (empty
    when ``m`` has none: a part). :class:`ManifestError` at the first that does not match."""
    metadata = b""
    for f in m.files:
        fd = files[f.name]
        if os.fstat(fd).st_size != f.size:
            raise ManifestError(f"{m.job}@{m.step}/{f.name}: not the {f.size} bytes the manifest says")
        if not f.size:
            m.verify_file(f.name, b"")
            continue
        with mmap.mmap(fd, f.size, prot=mmap.PROT_READ) as mm:
            if f.name == METADATA:
                metadata = bytes(mm)  # unpickled later from these very bytes
                m.verify_file(f.name, metadata)
                continue
            view = memoryview(mm)
            try:
                m.verify_file(f.name, view)
            finally:
                view.release()
    return metadata
