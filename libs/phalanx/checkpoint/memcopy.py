"""This node's checkpoints in shared memory: the copies the keeper holds there, reading
them, and filling new ones (a replica from a peer, a copy restored from a tier) chunk by
chunk, each chunk checked against its digest as it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import phalanx.checkpoint.paths as paths
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestError, digest
from phalanx.checkpoint.slots import SlotError, SlotFile, SlotState
from phalanx.checkpoint.tiers import step_key


@dataclass
class MemCopy:
    """A checkpoint in this node's shared memory: a held slot, or a directory of files."""

    manifest: Manifest
    files: dict[str, tuple[str, int]]  # name -> (path, offset)
    slot: SlotFile | None = None
    slot_seq: int = 0
    directory: Path | None = None  # a replica, a restored copy or a DCP checkpoint (removed on release)
    dir_fd: int = -1  # ``directory``, opened without following symlinks: files are read through it

    def intact(self) -> bool:
        """Still what was verified when it was taken or received (a slot not rewritten
        since, a directory not removed). Memory copies are not checksummed again on
        every read: that would double a restore from memory."""
        if self.slot is not None:
            try:
                h = self.slot.header()
            except SlotError:
                return False
            return h.seq == self.slot_seq and h.state is SlotState.HELD
        if self.directory is None or self.dir_fd < 0:
            return False
        try:
            for name in self.files:
                os.close(paths.open_file(self.dir_fd, name, os.O_RDONLY))
        except OSError:
            return False
        return all(Path(p).exists() for p, _ in self.files.values())

    def read(self, name: str) -> memoryview:
        path, offset = self.files[name]
        size = self.manifest.file(name).size
        if self.slot is not None:
            h = self.slot.header()
            if h.seq != self.slot_seq or h.state is not SlotState.HELD:
                raise ManifestError(f"{path}: the slot was rewritten (seq {h.seq}, {h.state.name})")
            return memoryview(self.slot.map)[offset : offset + size]
        return map_file(paths.open_file(self.dir_fd, name, os.O_RDONLY), offset, size, path)


def map_file(fd: int, offset: int, size: int, where: str) -> memoryview:
    """``size`` bytes at ``offset`` of the open file ``fd`` (closed here), mapped read-only."""
    try:
        if size == 0:
            return memoryview(b"")
        if os.fstat(fd).st_size < offset + size:
            raise ManifestError(f"{where}: shorter than the manifest says")
        return memoryview(mmap.mmap(fd, offset + size, prot=mmap.PROT_READ))[offset:]
    finally:
        os.close(fd)


FillInto = Callable[[FileEntry, int, memoryview], Awaitable[None]]
"""Fills ``into`` with the bytes of file ``entry`` from ``offset`` on (a peer's stream, a tier)."""


def _check_chunk(m: Manifest, f: FileEntry, i: int, got: str) -> None:
    if got != f.sha256[i]:
        raise ManifestError(f"{m.job}@{m.step}/{f.name}: chunk {i} does not match its digest on arrival")


def _allocate(dir_fd: int, name: str, size: int, group: int | None) -> int:
    """A new file ``name`` below ``dir_fd`` of ``size`` bytes, allocated whole; its descriptor."""
    fd = paths.open_file(dir_fd, name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640, create_dirs=0o750)
    try:
        if group is not None:
            os.fchown(fd, -1, group)
        if size:
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_manifest(dir_fd: int, m: Manifest, group: int | None) -> None:
    fd = _allocate(dir_fd, MANIFEST_NAME, 0, group)
    with os.fdopen(fd, "wb") as out:
        out.write(m.encode())


def _replace(dir_fd: int, tmp: str, name: str) -> None:
    """``tmp`` renamed to ``name`` in ``dir_fd``, what was there removed first."""
    paths.rmtree_at(dir_fd, name)
    paths.rename_at(dir_fd, tmp, name)


class SharedMemory:
    """The memory copies of this node's keeper, by (job, step): adopting a directory as
    one, releasing one (its slot freed, its directory removed), filling a new one."""

    def __init__(self, cfg: KeeperConfig, log: Any) -> None:
        self.cfg, self.log = cfg, log
        self.copies: dict[tuple[str, int], MemCopy] = {}
        self._fills = asyncio.Semaphore(cfg.max_fills)
        self._inflight = 0  # bytes of shared memory the fills under way will take

    def adopt(self, m: Manifest, directory: Path) -> MemCopy:
        """``directory`` (under this node's directory, reached without symlinks) as the
        memory copy of ``m``; its files are read through a descriptor of it from now on."""
        node_dir = self.cfg.node_dir
        dir_fd = paths.open_dir(node_dir, *directory.relative_to(node_dir).parts)
        old = self.copies.get((m.job, m.step))
        if old is not None:
            if old.directory != directory:
                self.release(old)
            elif old.dir_fd >= 0:
                os.close(old.dir_fd)
        mem = MemCopy(
            m, {f.name: (str(directory / f.name), 0) for f in m.files}, directory=directory, dir_fd=dir_fd
        )
        self.copies[(m.job, m.step)] = mem
        return mem

    def release(self, mem: MemCopy) -> None:
        if mem.slot is not None:
            with contextlib.suppress(SlotError):  # rewritten into something malformed: not ours to free
                h = mem.slot.header()
                if h.seq == mem.slot_seq and h.state is SlotState.HELD:
                    mem.slot.set_state(SlotState.FREE)
            mem.slot.close()
        elif mem.directory is not None:
            if mem.dir_fd >= 0:
                os.close(mem.dir_fd)
                mem.dir_fd = -1
            try:  # through directory descriptors: a link planted on the way is not followed
                paths.rmtree_at(self.cfg.node_dir, *mem.directory.relative_to(self.cfg.node_dir).parts)
            except OSError as exc:
                self.log.error("release_refused", directory=str(mem.directory), error=str(exc))

    def check_room(self, m: Manifest) -> None:
        """:class:`ManifestError` unless ``m`` fits: no larger than ``max_bytes``, and the
        shared memory free now (less what fills under way will take, and the reserve
        left for the ranks' slots) holds it. Checked before anything is allocated."""
        need = m.total_bytes
        if need > self.cfg.max_bytes:
            raise ManifestError(
                f"{m.job}@{m.step}: {need} bytes, over the largest checkpoint this keeper takes"
                f" ({self.cfg.max_bytes}, PHALANX_CKPT_MAX_BYTES): refused"
            )
        st = os.statvfs(self.cfg.node_dir)
        free = st.f_bavail * st.f_frsize - self._inflight - self.cfg.shm_reserve_bytes
        if need > free:
            raise ManifestError(
                f"{m.job}@{m.step}: {need} bytes, but {max(free, 0)} of shared memory are free for it"
                f" (keeping {self.cfg.shm_reserve_bytes} for the ranks): refused"
            )

    async def fill(self, m: Manifest, fill: FillInto, kind: str) -> Path:
        """Files of ``m`` into ``<node>/<kind>/<job>/<step>/`` in shared memory, each chunk
        checked against its digest as it arrives (hashed in a thread while the next one
        is read), the manifest written last; returns the directory.

        Bounded: ``m`` must fit (:meth:`check_room`); at most ``max_fills`` at once (one
        waits ``io_timeout_s`` for its turn, then is refused); ``fill`` bounds its own
        reads. The files are allocated whole first (``posix_fallocate``): filling a fresh
        tmpfs mapping page by page costs several times the copy itself."""
        self.check_room(m)
        try:
            await asyncio.wait_for(self._fills.acquire(), self.cfg.io_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.cfg.max_fills} copies are being filled already: busy") from None
        try:
            self.check_room(m)  # again: others may have filled meanwhile
            self._inflight += m.total_bytes
            try:
                return await self._fill_dir(m, fill, kind)
            finally:
                self._inflight -= m.total_bytes
        finally:
            self._fills.release()

    async def _fill_dir(self, m: Manifest, fill: FillInto, kind: str) -> Path:
        name = step_key(m.step)
        tmp = f".partial-{name}-{uuid.uuid4().hex[:8]}"  # one per fill: two fills of a step never share it
        group = self.cfg.job_group(m.job)
        job_fd = await asyncio.to_thread(
            paths.open_dir, self.cfg.node_dir, kind, m.job, create=0o750, group=group
        )
        try:
            await asyncio.to_thread(os.mkdir, tmp, 0o750, dir_fd=job_fd)
            try:
                tmp_fd = await asyncio.to_thread(paths.open_dir, job_fd, tmp)
                try:
                    if group is not None:
                        os.fchown(tmp_fd, -1, group)
                    for f in m.files:
                        await self._fill_file(m, f, tmp_fd, fill, group)
                    await asyncio.to_thread(_write_manifest, tmp_fd, m, group)
                finally:
                    os.close(tmp_fd)
                await asyncio.to_thread(_replace, job_fd, tmp, name)
            except BaseException:
                with contextlib.suppress(OSError):
                    paths.rmtree_at(job_fd, tmp)
                raise
        finally:
            os.close(job_fd)
        return self.cfg.node_dir / kind / m.job / name

    async def _fill_file(
        self, m: Manifest, f: FileEntry, dir_fd: int, fill: FillInto, group: int | None
    ) -> None:
        fd = await asyncio.to_thread(_allocate, dir_fd, f.name, f.size, group)
        try:
            if f.size == 0:
                _check_chunk(m, f, 0, digest(b""))
                return
            mm = mmap.mmap(fd, f.size)
        finally:
            os.close(fd)  # the mapping keeps the file
        view = memoryview(mm)
        hashing: asyncio.Future[str] | None = None
        try:
            for i, at in enumerate(range(0, f.size, m.chunk)):
                piece = view[at : at + m.chunk]
                await fill(f, at, piece)
                if hashing is not None:
                    _check_chunk(m, f, i - 1, await hashing)
                hashing = asyncio.ensure_future(asyncio.to_thread(digest, piece))
                del piece
            assert hashing is not None
            last, hashing = hashing, None
            _check_chunk(m, f, len(f.sha256) - 1, await last)
        finally:
            if hashing is not None:  # its thread still reads the mapping: let it finish first
                await asyncio.wait([hashing])
            view.release()
            with contextlib.suppress(BufferError):
                mm.close()  # else it goes with its last view
