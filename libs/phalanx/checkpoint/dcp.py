"""``torch.distributed.checkpoint`` through the tiers: a StorageWriter and a StorageReader.

:class:`TieredWriter` is DCP's ``FileSystemWriter`` aimed at this node's shared
memory; when DCP finishes a checkpoint it hands the directory to the node's
keeper, which checksums it and replicates and drains it like any snapshot.
:class:`TieredReader` asks the keeper for a verified copy (from whichever tier
has the newest good one) and reads it with DCP's ``FileSystemReader``::

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

from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from phalanx.checkpoint import wire
from phalanx.checkpoint.client import Checkpointer, Loaded
from phalanx.checkpoint.tiers import step_key


class TieredWriter(FileSystemWriter):
    def __init__(
        self, job: str, step: int, *, checkpointer: Checkpointer | None = None, **kwargs: Any
    ) -> None:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.ckpt = checkpointer or Checkpointer(job)
        self.step = step
        self.directory = self.ckpt.root / self.ckpt.node / "dcp" / job / step_key(step)
        self.directory.mkdir(parents=True, exist_ok=True)
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
    def __init__(
        self, job: str, step: int | None = None, *, checkpointer: Checkpointer | None = None
    ) -> None:
        ckpt = checkpointer or Checkpointer(job)
        self.loaded: Loaded = ckpt.fetch(step)
        if self.loaded.manifest.kind != "dcp":
            raise ValueError(
                f"checkpoint {job}@{self.loaded.step} is a Phalanx snapshot, not a DCP checkpoint:"
                " read it with Checkpointer.load"
            )
        name, (path, _offset) = next(iter(self.loaded.files.items()))
        root = Path(path)
        for _ in Path(name).parts:
            root = root.parent
        super().__init__(root)
