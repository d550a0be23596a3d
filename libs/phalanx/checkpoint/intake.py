"""What comes into a keeper's memory on its node: snapshots ranks leave in shared-memory
slots (taken: checksummed into a manifest, the slot HELD), DCP directories a job
registers, and -- after a restart -- what outlived the previous keeper (held and ready
slots, replicas and restored copies in shared memory, complete copies on disk, whose
unfinished drains are resumed). Every path is reached without following links, and only
where the job's own uid (or this keeper) owns it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import phalanx.checkpoint.paths as paths
from phalanx.checkpoint.catalog import COMPLETE
from phalanx.checkpoint.drains import Drains
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.jobdirs import holder_of, name_of_entry
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    MAX_PARTS,
    METADATA,
    FileEntry,
    Kind,
    Manifest,
    ManifestError,
    digest,
    digest_chunks,
    is_part,
    job_of,
)
from phalanx.checkpoint.memcopy import MemCopy, map_file
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.slots import SLOTS_MODE, SlotError, SlotFile, SlotHeader, SlotState, scan
from phalanx.checkpoint.tiers import DirTier, Tier, step_key
from phalanx.contract import DecodeError


class Intake:
    def __init__(
        self, cfg: KeeperConfig, holdings: Holdings, drains: Drains, rec: Recorder, log: Any
    ) -> None:
        self.cfg, self.holdings, self.drains, self.rec, self.log = cfg, holdings, drains, rec, log
        self.shm = holdings.shm
        self.node = cfg.node
        self._seen: set[tuple[str, int]] = set()  # (slot path hash, seq) taken
        self._scan_lock = asyncio.Lock()
        self._refused: dict[str, str] = {}  # path -> why, of what the scans refused (reported once)
        self._squats: set[str] = set()  # the fallback DCP directories reported (_report_squat)

    def prepare_node_dir(self) -> None:
        """``<node>/`` and its directories, this keeper's own: ``slots`` and ``dcp``
        sticky and open to every job (each makes its own directory there, none can
        move another's), ``replicas`` and ``restored`` written by the keeper alone. One
        that another uid owns is refused (its owner could plant links in it): start the
        keeper before the jobs of its node."""
        self.cfg.shm_root.mkdir(parents=True, exist_ok=True)
        me = os.geteuid()
        with paths.dir_at(self.cfg.shm_root, self.node, create=0o755) as node_fd:
            paths.check_owned(node_fd, me, str(self.cfg.node_dir))
            for kind, mode in (
                ("slots", SLOTS_MODE),
                ("dcp", SLOTS_MODE),
                ("replicas", 0o755),
                ("restored", 0o755),
            ):
                with paths.dir_at(node_fd, kind, create=mode) as fd:
                    st = os.fstat(fd)
                    if st.st_uid != me:
                        raise PermissionError(
                            f"{self.cfg.node_dir / kind} is owned by uid {st.st_uid}: the keeper"
                            f" (uid {me}) must own it; remove it and start the keeper first"
                        )
                    os.fchmod(fd, mode)  # a rank that came first made it with its umask

    # -- taking snapshots ------------------------------------------------------------------
    async def scan_loop(self) -> None:
        while True:
            try:
                await self.scan_once()
            except Exception as exc:
                self.log.error("scan_failed", error=repr(exc))
            await asyncio.sleep(self.cfg.scan_s)

    async def scan_once(self) -> None:
        """Take every READY slot (one scan at a time: a caller returns once what its scan
        found is taken, even when the scan loop got there first)."""
        async with self._scan_lock:
            await self._scan()

    async def _slots(self) -> tuple[list[tuple[str, SlotFile, SlotHeader]], dict[str, str]]:
        """Every well-formed slot of this node's jobs with its header, and each slot path
        refused (misplaced, foreign or malformed: closed, left where it is) with why."""
        found = await asyncio.to_thread(scan, self.cfg.shm_root, self.node, self.cfg.job_uid)
        refused = {str(p): why for p, why in found.refused}
        slots = []
        for job, f in found.slots:
            try:
                slots.append((job, f, f.header()))
            except SlotError as exc:
                refused[str(f.path)] = str(exc)
                f.close()
        return slots, refused

    async def _scan(self) -> None:
        slots, refused = await self._slots()
        for job, f, h in slots:
            if h.state is SlotState.READY and (str(f.path), h.seq) not in self._seen:
                self._seen.add((str(f.path), h.seq))
                await self._take(job, f)
            else:
                f.close()
        await self._report_refused(refused)

    async def _report_refused(self, refused: dict[str, str]) -> None:
        """Log and publish (an :class:`ErrorEvent`) each slot path the scans refuse, once
        while it stays refused for the same reason; the file is left where it is."""
        new = [(path, why) for path, why in refused.items() if self._refused.get(path) != why]
        self._refused = refused
        for path, why in new:
            self.rec.counters["refused"] += 1
            self.log.error("slot_refused", path=path, reason=why)
            await self.rec.bus.report_bad_input(f"slot {path}", DecodeError(f"{path}: {why}"[:4000], "slot"))

    async def _take(self, job: str, f: SlotFile) -> None:
        try:
            h = f.header()
        except SlotError as exc:  # rewritten into something malformed since the scan
            await self._report_refused({**self._refused, str(f.path): str(exc)})
            f.close()
            return
        t0 = time.perf_counter()
        data = f.data(h)
        digests = await asyncio.to_thread(digest_chunks, data)
        del data
        try:
            m = Manifest(
                job=job,
                step=h.step,
                kind="snapshot",
                origin=self.node,
                created=h.written_at,
                files=[FileEntry(name="state.phx", size=h.data_len, sha256=digests)],
                meta=h.meta,
            )
        except ValueError as exc:
            self.log.error("slot_refused", path=str(f.path), error=str(exc))
            f.set_state(SlotState.FREE)
            f.close()
            return
        f.set_state(SlotState.HELD)
        old = self.shm.copies.get((job, h.step))
        if old is not None:
            self.shm.release(old)
        self.shm.copies[(job, h.step)] = MemCopy(
            m, {"state.phx": (str(f.path), h.data_offset)}, slot=f, slot_seq=h.seq
        )
        self.rec.counters["taken"] += 1
        await self.rec.put_manifest(m)
        await self.rec.note(m, Tier.MEMORY, COMPLETE, seconds=time.perf_counter() - t0)
        self.drains.propagate(m)

    async def register_directory(
        self,
        job: str,
        step: int,
        directory: Path,
        kind: Kind = "dcp",
        *,
        parts: list[str] | None = None,
        files: list[str] | None = None,
    ) -> Manifest:
        """Adopt the files a writer left in ``directory`` (a DCP checkpoint) as a memory copy.

        ``directory`` must be ``<node>/dcp/<job>/<step:012d>`` (or, where another uid
        squatted ``dcp/<job>``, the job's fallback ``dcp/<job>.<16 hex>/<step:012d>``:
        :mod:`~phalanx.checkpoint.jobdirs`; the squat is reported), every component a
        real directory (no symlink), the job's directory and the step's owned by the
        job's uid and not writable by everyone, every file in it a regular file of that
        uid with one link: a job registers its own files only (PermissionError otherwise).

        With ``parts`` it is a *set* (:mod:`phalanx.checkpoint.manifest`): the directory
        holds ``.metadata`` alone, every part named is ``<job>=r<rank>`` with a manifest
        committed at ``step``, their files are disjoint and cover ``files`` (every file
        ``.metadata`` refers to, as the coordinator says: the keeper never unpickles it),
        and the set's manifest pins each part by its manifest's digest.
        :class:`ManifestError` otherwise, and nothing is committed: a set whose rank died
        before its part was registered is never listed."""
        entry = directory.parent.name  # the job's name, or its fallback's
        if (
            directory.parent.parent != self.cfg.node_dir / "dcp"
            or directory.name != step_key(step)
            or name_of_entry(entry) != job
        ):
            raise PermissionError(
                f"{directory} is not {self.cfg.node_dir / 'dcp' / job / step_key(step)} (nor a fallback"
                f" {job}.<16 hex> of it): a job registers its own DCP directory of that step only"
            )
        uid = self.cfg.job_uid(job)
        pins = None if parts is None else await self._pin_parts(job, step, parts, files or [])

        def build() -> Manifest:
            with paths.dir_at(self.cfg.node_dir, "dcp", entry) as job_fd:
                paths.check_owned(job_fd, uid, str(directory.parent))
                fd = paths.open_dir(job_fd, step_key(step))
            try:
                paths.check_owned(fd, uid, str(directory))
                entries = []
                for name, st in paths.regular_files(fd):
                    if name == MANIFEST_NAME:
                        continue
                    if st.st_uid != uid or st.st_nlink != 1:
                        raise PermissionError(
                            f"{directory / name}: owned by uid {st.st_uid}, {st.st_nlink} links"
                        )
                    view = map_file(
                        paths.open_file(fd, name, os.O_RDONLY), 0, st.st_size, str(directory / name)
                    )
                    entries.append(FileEntry(name=name, size=len(view), sha256=digest_chunks(view)))
                if not entries:
                    raise ManifestError(f"{directory}: no files to checkpoint")
                if pins is not None and [e.name for e in entries] != [METADATA]:
                    raise ManifestError(
                        f"{directory}: a set's directory holds {METADATA} alone, not"
                        f" {sorted(e.name for e in entries)[:8]}"
                    )
                m = Manifest(
                    job=job,
                    step=step,
                    kind=kind,
                    origin=self.node,
                    created=time.time(),
                    files=entries,
                    parts=pins or {},
                )
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                with open(paths.open_file(fd, MANIFEST_NAME, flags), "wb") as out:
                    out.write(m.encode())
                return m
            finally:
                os.close(fd)

        m = await asyncio.to_thread(build)
        if entry != job:
            await self._report_squat(job, entry)
        self.shm.adopt(m, directory)
        await self.rec.put_manifest(m)
        await self.rec.note(m, Tier.MEMORY, COMPLETE)
        self.drains.propagate(m)
        return m

    async def _report_squat(self, job: str, fallback: str) -> None:
        """Log and publish (an :class:`ErrorEvent`) that ``dcp/<job>`` is not the job's own
        (another uid's directory, a symlink): its files are kept in ``fallback``. Once per
        fallback directory, while this keeper runs."""
        if fallback in self._squats:
            return
        self._squats.add(fallback)
        where = self.cfg.node_dir / "dcp" / job
        with paths.dir_at(self.cfg.node_dir, "dcp") as dcp_fd:
            holder = holder_of(dcp_fd, job)
        reason = f"{where} ({holder}) is not the directory of {job}: its files are kept in {fallback}"
        self.log.error("job_dir_squatted", directory=str(where), reason=reason)
        await self.rec.bus.report_bad_input(f"dcp {where}", DecodeError(reason[:4000], "dcp"))

    async def _pin_parts(self, job: str, step: int, parts: list[str], files: list[str]) -> dict[str, str]:
        """Part job -> digest of its committed manifest at ``step``, for the set of ``job``
        (see :meth:`register_directory`); :class:`ManifestError` saying what is missing."""
        if is_part(job):
            raise ManifestError(f"{job!r} is a part: a part has no parts")
        if not parts or len(parts) > MAX_PARTS or len(set(parts)) != len(parts):
            raise ManifestError(f"{job}@{step}: a set needs 1-{MAX_PARTS} distinct parts")
        for part in parts:
            if not is_part(part) or job_of(part) != job:
                raise ManifestError(f"{part!r} is not a part of job {job!r}: the set is refused")
        limit = asyncio.Semaphore(32)

        async def committed(part: str) -> Manifest | None:
            async with limit:
                return await self.rec.catalog.manifest(part, step)

        manifests = await asyncio.gather(*(committed(p) for p in parts))
        owner: dict[str, str] = {}  # file -> the part that has it
        pins = {}
        for part, m in zip(parts, manifests, strict=True):
            if m is None or m.job != part or m.kind != "dcp" or m.parts:
                raise ManifestError(
                    f"part {part}@{step} is not committed: the set of {job}@{step} is refused"
                )
            for f in m.files:
                if f.name == METADATA:
                    raise ManifestError(f"part {part}@{step} has a {METADATA}: the set is refused")
                if f.name in owner:
                    raise ManifestError(
                        f"{f.name} is in parts {owner[f.name]} and {part}: the set is refused"
                    )
                owner[f.name] = part
            pins[part] = digest(m.encode())
        missing = sorted(set(files) - owner.keys())
        if missing:
            raise ManifestError(
                f"{job}@{step}: no part has {missing[:8]} ({len(missing)} files): the set is refused"
            )
        return pins

    # -- after a restart -------------------------------------------------------------------
    async def adopt(self) -> None:
        """Re-adopt what outlived the previous keeper of this node, and finish its work."""
        held: set[tuple[str, int, Tier]] = set()  # what this node really holds
        # Slots a previous keeper held: hold them again (READY ones the scan takes). A
        # malformed or misplaced one is reported and left as it is, never fatal.
        slots, refused = await self._slots()
        for job, f, h in slots:
            if h.state is SlotState.HELD:
                f.set_state(SlotState.READY)  # taken again: checksummed and propagated as new
            if h.state in (SlotState.HELD, SlotState.READY):
                held.add((job, h.step, Tier.MEMORY))
            f.close()
        await self._report_refused(refused)
        # Replicas and restored copies in shared memory (reached without following links).
        for kind in ("replicas", "restored"):
            for job, name in await asyncio.to_thread(self._copies_in, kind):
                d = self.cfg.node_dir / kind / job / name
                try:
                    if name.startswith((".partial-", ".deleting-")):
                        raise ManifestError("left by an interrupted write")
                    with paths.dir_at(self.cfg.node_dir, kind, job, name) as fd:
                        with open(paths.open_file(fd, MANIFEST_NAME, os.O_RDONLY), "rb") as mf:
                            m = Manifest.parse(mf.read(MAX_MANIFEST_BYTES + 1), str(d))
                    if m.job != job or step_key(m.step) != name:
                        raise ManifestError(f"{d} holds {m.job}@{m.step}")
                    self.shm.adopt(m, d)
                except (OSError, ManifestError) as exc:
                    self.log.info("shm_copy_removed", directory=str(d), reason=str(exc))
                    with contextlib.suppress(OSError):
                        paths.rmtree_at(self.cfg.node_dir, kind, job, name)
                    continue
                await self.rec.note(m, Tier.MEMORY, COMPLETE, detail="adopted after a restart")
        # Complete copies on this node's disk: list them again; resume their drains.
        disk = self.holdings.stores.get(Tier.DISK)
        if isinstance(disk, DirTier):
            for job in disk.jobs():
                removed = disk.clean_partials(job)
                if removed:
                    self.log.info("partials_removed", job=job, tier="disk", count=removed)
                for m in disk.manifests(job):
                    held.add((m.job, m.step, Tier.DISK))
                    await self.rec.note(m, Tier.DISK, COMPLETE, detail="adopted after a restart")
                    if m.origin == self.node:
                        self.rec.tasks.spawn(self.drains.resume(m), f"keeper-resume-{m.job}-{m.step}")
        # What the catalog says this node holds and it does not (a node that came back
        # without its memory, or its disk): those copies are gone.
        held |= {(j, st, Tier.MEMORY) for (j, st) in self.shm.copies}
        catalog = self.rec.catalog
        for job, step, tier in await catalog.copies_on(self.node):
            if (job, step, tier) not in held:
                await catalog.forget(job, step, tier, self.node)
                self.log.info("copy_gone", job=job, step=step, tier=tier.value)

    def _copies_in(self, kind: str) -> list[tuple[str, str]]:
        """(job, entry) of every entry of ``<node>/<kind>/<job>/``; a job directory that is
        not a real directory of this keeper is reported and left alone."""
        out: list[tuple[str, str]] = []
        with paths.dir_at(self.cfg.node_dir, kind) as kind_fd:
            for job in sorted(os.listdir(kind_fd)):
                try:
                    with paths.dir_at(kind_fd, job) as job_fd:
                        if os.fstat(job_fd).st_uid != os.geteuid():
                            raise PermissionError(f"owned by uid {os.fstat(job_fd).st_uid}")
                        out.extend((job, name) for name in sorted(os.listdir(job_fd)))
                except OSError as exc:
                    where = str(self.cfg.node_dir / kind / job)
                    self.log.error("shm_dir_refused", directory=where, error=str(exc))
        return out
