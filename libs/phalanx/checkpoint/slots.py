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
    64   the metadata of :func:`phalanx.checkpoint.packing.pack` (msgpack)
    ...  the data

A slot survives its rank (tmpfs outlives processes), not its node.

Isolation: ``slots/`` is sticky and open to every uid (like ``/tmp``: a job
creates its own directory there, nobody can rename or remove another's);
``slots/<job>/`` is created by the job's first rank, mode 0770 (its uid and
group: the keeper reaches it as a member of the job's group, or as root). A rank
never uses one that another uid owns, or a symlink: it says so and keeps its slots
in a fallback directory ``slots/<job>.<16 hex>`` of its own
(:func:`phalanx.checkpoint.jobdirs.own_job_dir`). The keeper (:func:`scan`) takes a
slot only from a job's directory (under either name) owned by the uid it expects
for that job and not writable by everyone, only from a regular file (no symlink
followed) owned by that same uid with one link: a file another job planted there,
or a hard link to another job's slot, is refused. A slot file whose header is
malformed is refused too (:class:`SlotError`) and left where it is.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

import phalanx.checkpoint.paths as paths
from phalanx.checkpoint.jobdirs import SHARED_MODE, name_of_entry, own_job_dir
from phalanx.settings import NodeSettings, load

if TYPE_CHECKING:  # the keeper runs without torch; a rank has it
    import torch

    from phalanx.checkpoint.packing import Packing

MAGIC = b"PHXSLOT1"
_HEAD = struct.Struct("<8sIIQqQQd")
_META_AT = 64
_PAGE = 4096
_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SLOT = re.compile(r"^[A-Za-z0-9_.-]{1,128}\.slot$")
SLOTS_MODE = SHARED_MODE  # <node>/slots: sticky, every job may create its directory
SLOT_MODE = 0o660


class SlotState(IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2
    HELD = 3


def _page_up(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def node_name() -> str:
    """This node's name, as the keeper and the launcher use it (letters, digits, '_' and '-')."""
    raw = load(NodeSettings).node or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9_-]", "_", raw)[:48] or "node"


def shm_root() -> Path:
    """Where ranks and keepers share memory: ``PHALANX_SHM_ROOT``, else /dev/shm/phalanx."""
    return load(NodeSettings).shm_root


class SlotError(ValueError):
    """A slot file that is not a well-formed snapshot slot (refused, left in place)."""


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

    def __init__(self, path: Path, create_bytes: int = 0, *, fd: int | None = None) -> None:
        """``fd``: the file, already opened (the keeper opens it without following
        symlinks and checks its owner first); it is this object's from now on."""
        self.path = path
        if fd is None:
            flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create_bytes else 0)
            fd = os.open(path, flags, SLOT_MODE)
        self.fd = fd
        size = os.fstat(self.fd).st_size
        if create_bytes and size < create_bytes:
            os.posix_fallocate(self.fd, 0, create_bytes)  # whole pages now, not one fault at a time
            size = create_bytes
        if size < _PAGE:
            os.close(self.fd)
            raise SlotError(f"{path}: {size} bytes is not a snapshot slot")
        self.map = mmap.mmap(self.fd, size)
        self._view: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.map)

    def header(self) -> SlotHeader:
        """The header; :class:`SlotError` if it is malformed (a state, a step or a layout
        no rank writes)."""
        magic, state, meta_len, seq, step, off, n, at = _HEAD.unpack_from(self.map, 0)
        if magic != MAGIC:
            return SlotHeader(SlotState.FREE, 0, -1, b"", 0, 0, 0.0)  # never written
        if state not in SlotState._value2member_map_:
            raise SlotError(f"{self.path}: state {state} is not a slot state")
        if state in (SlotState.READY, SlotState.HELD):
            if step < 0 or off % _PAGE or off < _page_up(_META_AT + meta_len) or off + n > len(self.map):
                raise SlotError(
                    f"{self.path}: bad layout (step {step}, metadata {meta_len} bytes, data {n} bytes"
                    f" at {off}, file {len(self.map)} bytes)"
                )
        meta = bytes(self.map[_META_AT : _META_AT + meta_len]) if _META_AT + meta_len <= off else b""
        return SlotHeader(SlotState(state), seq, step, meta, off, n, at)

    def raw_seq(self) -> int:
        """The sequence number, whatever the rest of the header says."""
        return int(struct.unpack_from("<Q", self.map, 16)[0]) if self.map[:8] == MAGIC else 0

    def set_state(self, state: SlotState) -> None:
        struct.pack_into("<I", self.map, 8, int(state))

    def data(self, h: SlotHeader) -> memoryview:
        return memoryview(self.map)[h.data_offset : h.data_offset + h.data_len]

    def grow(self, size: int) -> None:
        self._view = None
        old = len(self.map)
        self.map.close()
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError:  # ENOSPC: still the slot it was (H1)
            self.map = mmap.mmap(self.fd, old)
            raise
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


@dataclass(frozen=True)
class Claim:
    """A slot :meth:`SnapshotSlots.claim` marked WRITING for snapshot ``step``."""

    file: SlotFile
    step: int
    seq: int
    offset: int  # of the data in the file
    meta: bytes
    size: int  # of the data

    @property
    def data(self) -> torch.Tensor:
        """The data area, as a uint8 tensor (a view of the mapping)."""
        return self.file.tensor()[self.offset : self.offset + self.size]


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
        if not _JOB.match(job):
            raise ValueError(f"{job!r} is not a job name (1-64 of letters, digits, '_', '-')")
        own = own_job_dir(shm_root / node, "slots", job)  # a fallback where the job's name is squatted
        self.dir, self.dir_fd = own.path, own.fd
        self.worker, self.count = worker, count
        self.files: dict[int, SlotFile] = {}

    def _name(self, i: int) -> str:
        return f"{self.worker}.{i}.slot"

    def _slot(self, i: int, need: int) -> SlotFile:
        f = self.files.get(i)
        if f is None:
            fd = os.open(
                self._name(i),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                SLOT_MODE,
                dir_fd=self.dir_fd,
            )
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_nlink != 1:
                os.close(fd)
                raise PermissionError(f"{self.dir / self._name(i)} is not this process's own slot file")
            os.fchmod(fd, SLOT_MODE)
            if st.st_size < need:
                try:
                    os.posix_fallocate(fd, 0, need)  # whole pages now, not one fault at a time
                except OSError:  # ENOSPC: no slot left behind that is not one (H1)
                    os.close(fd)
                    if st.st_size == 0:
                        os.unlink(self._name(i), dir_fd=self.dir_fd)
                    raise
            f = self.files[i] = SlotFile(self.dir / self._name(i), fd=fd)
        if f.size < need:
            f.grow(need)
        return f

    def free_slot(self) -> int | None:
        """A FREE slot (the least recently written), or None."""
        best: tuple[int, int] | None = None
        for i in range(self.count):
            if i not in self.files:
                try:
                    os.stat(self._name(i), dir_fd=self.dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    return i
            f = self.files.get(i) or self._slot(i, 0)
            try:
                h = f.header()
            except SlotError:  # this rank's own slot, damaged: rewritten like a half-written one
                h = SlotHeader(SlotState.WRITING, f.raw_seq(), -1, b"", 0, 0, 0.0)
            if h.state in (SlotState.FREE, SlotState.WRITING) and (best is None or h.seq < best[1]):
                best = (i, h.seq)  # WRITING: this rank died mid-write before; nobody else writes it
        return None if best is None else best[0]

    def reserve(self, packing: Packing) -> int:
        """Grow every FREE slot to hold ``packing`` and touch its pages; returns how many."""
        need = _page_up(_META_AT + len(packing.meta)) + _page_up(max(packing.size, 1))
        done = 0
        for i in range(self.count):
            f = self._slot(i, _PAGE)
            with contextlib.suppress(SlotError):
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
        claim = self.claim(step, packing)
        packing.copy_into(claim.data)
        return self.publish(claim, started)

    def claim(self, step: int, packing: Packing) -> Claim:
        """A free slot sized for ``packing``, marked WRITING (the keeper reads nothing of
        it until :meth:`publish`): its data area for the caller to fill, in one go
        (:meth:`write`) or in pieces beside the next step (:mod:`~phalanx.checkpoint.overlap`).
        :class:`SlotsBusy` when the keeper holds every slot."""
        i = self.free_slot()
        if i is None:
            raise SlotsBusy(f"all {self.count} snapshot slots of {self.worker} in {self.dir} are held")
        off = _page_up(_META_AT + len(packing.meta))
        f = self._slot(i, off + _page_up(max(packing.size, 1)))
        old_seq = f.raw_seq()
        if old_seq:
            f.set_state(SlotState.WRITING)
        return Claim(f, step, old_seq + 1, off, packing.meta, packing.size)

    def publish(self, claim: Claim, started: float) -> Written:
        """Mark a :meth:`claim` whose data is filled READY (its header last); returns what
        was written, ``started`` being when the save began (``perf_counter``)."""
        f, meta = claim.file, claim.meta
        f.map[_META_AT : _META_AT + len(meta)] = meta
        _HEAD.pack_into(
            f.map,
            0,
            MAGIC,
            SlotState.WRITING,
            len(meta),
            claim.seq,
            claim.step,
            claim.offset,
            claim.size,
            time.time(),
        )
        f.set_state(SlotState.READY)  # last: the keeper reads nothing before this
        return Written(f.path, claim.step, claim.seq, claim.size, time.perf_counter() - started)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1


@dataclass
class Scan:
    """What :func:`scan` found: the slots it may take, and what it refused (path, why)."""

    slots: list[tuple[str, SlotFile]]
    refused: list[tuple[Path, str]]


def scan(shm_root: Path, node: str, owner: Callable[[str], int]) -> Scan:
    """Every slot file on ``node`` the keeper may take, opened: (job, slot); the caller
    closes each (or keeps it). ``owner(job)``: the uid that must own the job's slot
    directory (``slots/<job>``, or a fallback ``slots/<job>.<16 hex>``) and every slot
    file in it. Nothing is followed through a symlink; whatever is refused is listed
    with the reason and left in place."""
    out = Scan([], [])
    base = shm_root / node / "slots"
    try:
        slots_fd = paths.open_dir(shm_root, node, "slots")
    except FileNotFoundError:
        return out
    except OSError as exc:
        out.refused.append((base, f"not a directory of this keeper: {exc}"))
        return out
    try:
        for entry in sorted(os.listdir(slots_fd)):
            where = base / entry
            job = name_of_entry(entry)  # the job's own name, or its fallback's
            if job is None or not _JOB.match(job):
                out.refused.append((where, "not a job name"))
                continue
            try:
                job_fd = paths.open_dir(slots_fd, entry)
            except FileNotFoundError:
                continue
            except OSError as exc:
                out.refused.append((where, f"not a directory (a symlink?): {exc.strerror}"))
                continue
            try:
                uid = paths.check_owned(job_fd, owner(job), str(where)).st_uid
                out.slots.extend((job, f) for f in _slots_in(job_fd, where, uid, out.refused))
            except PermissionError as exc:
                out.refused.append((where, str(exc.strerror or exc)))
            finally:
                os.close(job_fd)
    finally:
        os.close(slots_fd)
    return out


def _slots_in(job_fd: int, where: Path, uid: int, refused: list[tuple[Path, str]]) -> Iterator[SlotFile]:
    for name in sorted(os.listdir(job_fd)):
        path = where / name
        if not _SLOT.match(name):
            if name.endswith(".slot"):
                refused.append((path, "not a slot file name (letters, digits, '_.-')"))
            continue
        try:
            fd = paths.open_file(job_fd, name, os.O_RDWR)
        except FileNotFoundError:
            continue
        except OSError as exc:
            refused.append((path, f"not a regular file (a symlink?): {exc.strerror or exc}"))
            continue
        st = os.fstat(fd)
        if st.st_uid != uid or st.st_nlink != 1:
            os.close(fd)
            why = f"owned by uid {st.st_uid}, its job directory by uid {uid}" if st.st_uid != uid else ""
            refused.append((path, why or f"{st.st_nlink} links to it (a hard link to another slot?)"))
            continue
        try:
            yield SlotFile(path, fd=fd)
        except (OSError, SlotError) as exc:
            refused.append((path, str(exc)))
