"""Shared-memory snapshot slots: how a rank hands a snapshot to its node's keeper.

A rank owns a few slot files under ``<shm_root>/<node>/slots/<job>/`` (tmpfs:
``/dev/shm``). Taking a snapshot is one copy of the state into a slot it has
mapped before, so the pages are already there: on this box a reused 1 GiB
buffer takes 0.10 s to fill, a fresh one 2.3 s (page faults and zeroing). The
slot then says READY; the keeper (state-replication on the node) checksums
it, replicates and drains it, and holds it as the checkpoint's memory copy
until a newer one takes its place, then frees it for the rank to reuse. The
rank only ever writes a FREE slot; the keeper only moves READY to HELD and
HELD to FREE: one writer per transition, no lock between the processes.

A slot file::

    0    magic "PHXSLOT1"
    8    state  u32 (FREE 0, WRITING 1, READY 2, HELD 3)
    12   meta length u32
    16   seq u64 (bumped on every write: a reader checks it did not change)
    24   step i64
    32   data offset u64 (4096-aligned, after the metadata)
    40   data length u64
    48   written at (unix time) f64
    64   the metadata of :func:`phalanx.runtime.state.pack` (msgpack)
    ...  the data

A slot survives its rank (tmpfs outlives processes), not its node.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

from phalanx.settings import get_settings

if TYPE_CHECKING:  # the keeper runs without torch; a rank has it
    import torch

    from phalanx.runtime.state import Packing

MAGIC = b"PHXSLOT1"
_HEAD = struct.Struct("<8sIIQqQQd")
_META_AT = 64
_PAGE = 4096


class SlotState(IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    HELD = 3


def _page_up(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def node_name() -> str:
    """This node's name, as the keeper and the launcher use it (letters, digits, '_' and '-')."""
    raw = get_settings().node or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:48] or "node"


def shm_root() -> Path:
    """Where ranks and keepers share memory: ``PHALANX_SHM_ROOT``, else /dev/shm/phalanx."""
    return get_settings().shm_root


def slot_dir(shm_root: Path, node: str, job: str) -> Path:
    return shm_root / node / "slots" / job


@dataclass(frozen=True)
class SlotHeader:
    state: SlotState
    seq: int
    step: int
    meta: bytes
    data_offset: int
    data_len: int
    written_at: float


class SlotFile:
    """One mapped slot file (either side)."""

    def __init__(self, path: Path, create_bytes: int = 0) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT if create_bytes else 0)
        self.fd = os.open(path, flags, 0o600)
        size = os.fstat(self.fd).st_size
        if create_bytes and size < create_bytes:
            os.posix_fallocate(self.fd, 0, create_bytes)  # whole pages now, not one fault at a time
            size = create_bytes
        if size < _PAGE:
            os.close(self.fd)
            raise ValueError(f"{path}: {size} bytes is not a snapshot slot")
        self.map = mmap.mmap(self.fd, size)
        self._view: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.map)

    def header(self) -> SlotHeader:
        magic, state, meta_len, seq, step, off, n, at = _HEAD.unpack_from(self.map, 0)
        if magic != MAGIC:
            return SlotHeader(SlotState.FREE, 0, -1, b"", 0, 0, 0.0)  # never written
        meta = bytes(self.map[_META_AT : _META_AT + meta_len]) if meta_len < off else b""
        return SlotHeader(SlotState(state), seq, step, meta, off, n, at)

    def set_state(self, state: SlotState) -> None:
        struct.pack_into("<I", self.map, 8, int(state))

    def data(self, h: SlotHeader) -> memoryview:
        return memoryview(self.map)[h.data_offset : h.data_offset + h.data_len]

    def grow(self, size: int) -> None:
        self._view = None
        self.map.close()
        os.posix_fallocate(self.fd, 0, size)
        self.map = mmap.mmap(self.fd, size)

    def tensor(self) -> torch.Tensor:
        """The whole mapping as a uint8 tensor (kept: building it costs a syscall)."""
        import torch

        if self._view is None:
            self._view = torch.frombuffer(self.map, dtype=torch.uint8)
        return self._view

    def close(self) -> None:
        self._view = None
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still out there; the mapping goes with the process
        os.close(self.fd)


@dataclass(frozen=True)
class Written:
    """Where :meth:`SnapshotSlots.write` put a snapshot."""

    path: Path
    step: int
    seq: int
    bytes: int
    seconds: float


class SlotsBusy(RuntimeError):
    """Every slot still holds a snapshot the keeper has not released."""


class SnapshotSlots:
    """A rank's slots (``count`` of them) for ``job`` on ``node``.

    >>> slots = SnapshotSlots(Path("/dev/shm/phalanx"), "node-a", "j1", "w0")   # doctest: +SKIP
    >>> slots.write(40, Packing.of(state, torch.device("cpu")))                 # doctest: +SKIP
    """

    def __init__(self, shm_root: Path, node: str, job: str, worker: str, count: int = 3) -> None:
        if count < 1:
            raise ValueError("need at least one snapshot slot")
        self.dir = slot_dir(shm_root, node, job)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.worker, self.count = worker, count
        self.files: dict[int, SlotFile] = {}

    def _slot(self, i: int, need: int) -> SlotFile:
        f = self.files.get(i)
        if f is None:
            f = self.files[i] = SlotFile(self.dir / f"{self.worker}.{i}.slot", create_bytes=need)
        if f.size < need:
            f.grow(need)
        return f

    def free_slot(self) -> int | None:
        """A FREE slot (the least recently written), or None."""
        best: tuple[int, int] | None = None
        for i in range(self.count):
            path = self.dir / f"{self.worker}.{i}.slot"
            if i not in self.files and not path.exists():
                return i
            f = self.files.get(i) or self._slot(i, 0)
            h = f.header()
            if h.state in (SlotState.FREE, SlotState.WRITING) and (best is None or h.seq < best[1]):
                best = (i, h.seq)  # WRITING: this rank died mid-write before; nobody else writes it
        return None if best is None else best[0]

    def reserve(self, packing: Packing) -> int:
        """Grow every FREE slot to hold ``packing`` and touch its pages; returns how many."""
        need = _page_up(_META_AT + len(packing.meta)) + _page_up(max(packing.size, 1))
        done = 0
        for i in range(self.count):
            f = self._slot(i, _PAGE)
            if f.header().state is not SlotState.FREE:
                continue
            f = self._slot(i, need)
            f.tensor()[_PAGE:].fill_(0)  # faults every page in (the header page is in already)
            done += 1
        return done

    def write(self, step: int, packing: Packing) -> Written:
        """Copy the state laid out by ``packing`` into a free slot and mark it READY.

        Raises :class:`SlotsBusy` when the keeper holds every slot (it is behind, or
        not running): the caller decides whether to skip this snapshot.
        """
        started = time.perf_counter()
        i = self.free_slot()
        if i is None:
            raise SlotsBusy(f"all {self.count} snapshot slots of {self.worker} in {self.dir} are held")
        off = _page_up(_META_AT + len(packing.meta))
        f = self._slot(i, off + _page_up(max(packing.size, 1)))
        old = f.header()
        if old.seq:
            f.set_state(SlotState.WRITING)
        seq = old.seq + 1
        packing.copy_into(f.tensor()[off : off + packing.size])
        f.map[_META_AT : _META_AT + len(packing.meta)] = packing.meta
        _HEAD.pack_into(
            f.map, 0, MAGIC, SlotState.WRITING, len(packing.meta), seq, step, off, packing.size, time.time()
        )
        f.set_state(SlotState.READY)  # last: the keeper reads nothing before this
        return Written(f.path, step, seq, packing.size, time.perf_counter() - started)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


def scan(shm_root: Path, node: str) -> Iterator[tuple[str, SlotFile]]:
    """Every slot file on ``node``, opened: (job, slot). The caller closes each (or keeps it)."""
    base = shm_root / node / "slots"
    if not base.is_dir():
        return
    for d in sorted(base.iterdir()):
        for path in sorted(d.glob("*.slot")) if d.is_dir() else []:
            try:
                yield d.name, SlotFile(path)
            except (OSError, ValueError):
                continue  # gone, or not a slot
