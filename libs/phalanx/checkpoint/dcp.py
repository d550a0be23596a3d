"""``torch.distributed.checkpoint`` through the tiers: a StorageWriter and a StorageReader.

:class:`TieredWriter` is DCP's ``FileSystemWriter`` aimed at this node's shared
memory; when DCP finishes a checkpoint it hands the directory to the node's
keeper, which checksums it and replicates and drains it like any snapshot.
:class:`TieredReader` asks the keeper for a verified copy (from whichever tier
has the newest good one) and reads it with DCP's ``FileSystemReader``, but only
after checking every file, in this process, against the SHA-256 digests of the
manifest the keeper answered with (the one committed in the catalog: the keeper
serves no other). DCP unpickles ``.metadata`` (and ``torch.load``-s byte items
from the data files), so a planted or altered file would run code in the rank:
none is handed to DCP before its digest matched, and ``.metadata`` is unpickled
from the very bytes that were checked, never read again from the file. The rank
trusts its node's keeper (reached through a Unix socket in the keeper's own
directory) for which manifest is committed; it checks the bytes itself.

::

    import torch.distributed.checkpoint as dcp
    fut = dcp.async_save(state, storage_writer=TieredWriter("j1", step=100))
    ...
    dcp.load(state, storage_reader=TieredReader("j1"))        # the newest; or step=100

Scope: the files of one checkpoint must be written on one node (a single
process, or the ranks of one node); a checkpoint whose ranks span nodes would
be split across keepers, and is refused nowhere but not supported yet.
``sync_files`` is off: the keeper fsyncs what it drains to disk, file by file
(DCP's ``sync_files=True`` calls a machine-wide ``os.sync()``).
"""

from __future__ import annotations

import mmap
import os
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

import phalanx.checkpoint.wire as wire
from phalanx.checkpoint.client import Checkpointer, Loaded
from phalanx.checkpoint.manifest import Manifest, ManifestError
from phalanx.checkpoint.tiers import step_key

METADATA = ".metadata"  # DCP's metadata file (a pickle)


class TieredWriter(FileSystemWriter):
    def __init__(
        self, job: str, step: int, *, checkpointer: Checkpointer | None = None, **kwargs: Any
    ) -> None:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.ckpt = checkpointer or Checkpointer(job)
        self.step = step
        job_dir = self.ckpt.root / self.ckpt.node / "dcp" / job
        if not job_dir.is_dir():
            job_dir.mkdir(mode=0o770, parents=True, exist_ok=True)
            os.chmod(job_dir, 0o770)  # the job's and the keeper's, nobody else's (past the umask)
        self.directory = job_dir / step_key(step)
        self.directory.mkdir(exist_ok=True)
        kwargs.setdefault("sync_files", False)
        super().__init__(self.directory, **kwargs)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        wire.call(
            self.ckpt.socket,
            {"op": "register", "job": self.ckpt.job, "step": self.step, "dir": str(self.directory)},
            self.ckpt.timeout_s,
        )


class TieredReader(FileSystemReader):
    """DCP's reader of checkpoint ``step`` (None: the newest) of ``job``, every file
    verified first (:class:`ManifestError` if one does not match: nothing was read)."""

    def __init__(
        self, job: str, step: int | None = None, *, checkpointer: Checkpointer | None = None
    ) -> None:
        ckpt = checkpointer or Checkpointer(job)
        self.loaded: Loaded = ckpt.fetch(step)
        m = self.loaded.manifest
        if m.kind != "dcp":
            raise ValueError(
                f"checkpoint {job}@{self.loaded.step} is a Phalanx snapshot, not a DCP checkpoint:"
                " read it with Checkpointer.load"
            )
        name, (path, _offset) = next(iter(self.loaded.files.items()))
        root = Path(path)
        for _ in Path(name).parts:
            root = root.parent
        self._metadata = verified(m, root)
        super().__init__(root)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata, unpickled from the bytes whose digest matched (one file, written
        by one process: a per-rank ``__<rank>.metadata`` is not supported)."""
        if kwargs.get("rank") is not None:
            raise ValueError("TieredReader reads one .metadata, not one per rank")
        metadata = pickle.loads(self._metadata)  # these bytes matched the committed digest
        if not isinstance(metadata, Metadata):
            raise ManifestError(
                f"{METADATA} of {self.loaded.manifest.job}@{self.loaded.step} is not DCP metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


def verified(m: Manifest, root: Path) -> bytes:
    """Check every file of ``m`` under ``root`` against its digests (the files DCP will
    open, as it will open them); the bytes of ``.metadata``. :class:`ManifestError`
    at the first that does not match, or when there is no ``.metadata``."""
    m.file(METADATA)  # a DCP checkpoint without one is not one
    metadata = b""
    for f in m.files:
        with open(root / f.name, "rb") as fh:
            if os.fstat(fh.fileno()).st_size != f.size:
                raise ManifestError(f"{root / f.name}: not the {f.size} bytes the manifest says")
            if f.name == METADATA or not f.size:
                data = fh.read(f.size)
                m.verify_file(f.name, data)
                if f.name == METADATA:
                    metadata = data
                continue
            with mmap.mmap(fh.fileno(), f.size, prot=mmap.PROT_READ) as mm:
                view = memoryview(mm)
                try:
                    m.verify_file(f.name, view)
                finally:
                    view.release()
    return metadata
