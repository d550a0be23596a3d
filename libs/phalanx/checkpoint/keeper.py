"""The keeper: one per node (the state-replication service), owner of the node's checkpoints.

What it does with a snapshot a rank left in a shared-memory slot
(:mod:`phalanx.checkpoint.slots`), in this order and off the training thread:

1. **take** it: checksum it into a :class:`Manifest`, mark the slot HELD; the
   checkpoint is now complete in ``memory`` on this node;
2. **replicate** it to ``replicas`` keepers on other nodes over TCP (their
   addresses are in the catalog), each of which verifies the checksums and keeps
   it in its own shared memory: losing this node loses no checkpoint;
3. **drain** it, one checkpoint at a time, to ``disk``, then ``shared``, then
   ``object`` (each that is configured), committing the manifest last;
4. apply each tier's :class:`RetentionPolicy`; a memory copy is released (its
   slot freed for the rank) only once a durable copy exists.

Every copy's state goes to the catalog (KV) and as a :class:`CheckpointEvent`.

A rank asks its keeper (Unix socket ``<shm_root>/<node>/keeper.sock``) to
``list`` checkpoints and to ``load`` one: the keeper finds the newest complete
checkpoint (or the asked step), makes sure a verified copy is in this node's
memory -- from its own memory, its disk, a peer, the shared path or the object
store, the first that has a good one -- and answers with the files' paths; a
copy that fails its checksums is reported corrupt and rewritten from the good
one. On start the keeper re-adopts what survived it: held and ready slots,
replicas in shared memory, complete copies on disk (partial ones are removed)
and resumes their unfinished drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace

import phalanx.checkpoint.paths as paths
import phalanx.checkpoint.peerauth as peerauth
import phalanx.checkpoint.wire as wire
from phalanx.bus import Bus
from phalanx.bus.subjects import CHECKPOINT
from phalanx.checkpoint.catalog import COMPLETE, SHARED_NODE, Catalog, Entry
from phalanx.checkpoint.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Kind,
    Manifest,
    ManifestError,
    digest,
    digest_chunks,
)
from phalanx.checkpoint.retention import RetentionPolicy
from phalanx.checkpoint.slots import SLOTS_MODE, SlotError, SlotFile, SlotHeader, SlotState, scan
from phalanx.checkpoint.tiers import (
    DRAIN_ORDER,
    DirTier,
    ObjectTier,
    RetryPolicy,
    Store,
    Tier,
    step_key,
)
from phalanx.schemas import CheckpointEvent, DecodeError
from phalanx.schemas.messages import CopyState
from phalanx.telemetry import get_logger

tracer = trace.get_tracer("phalanx.checkpoint")


@dataclass
class KeeperConfig:
    node: str
    shm_root: Path = Path("/dev/shm/phalanx")
    disk_root: Path | None = None
    shared_root: Path | None = None
    object_url: str | None = None
    host: str = "127.0.0.1"  # where peers reach this keeper (TCP)
    port: int = 0
    replicas: int = 1
    retention: dict[Tier, RetentionPolicy] = field(
        default_factory=lambda: {
            Tier.MEMORY: RetentionPolicy(2),
            Tier.DISK: RetentionPolicy(5),
            Tier.SHARED: RetentionPolicy(5),
            Tier.OBJECT: RetentionPolicy(3, 0),
        }
    )
    scan_s: float = 0.05
    fsync: bool = True
    connect_timeout_s: float = 2.0
    key: bytes = b""
    """The cluster's keeper key (:mod:`phalanx.checkpoint.peerauth`): required, >= 32 bytes."""
    auth_timeout_s: float = 5.0  # a peer that has not proved the key by then is dropped
    io_timeout_s: float = 30.0  # the longest wait for any read or write with a peer
    min_rate: float = float(8 << 20)  # bytes/s: a slower transfer, on the whole, is dropped
    max_bytes: int = 64 << 30  # the largest checkpoint received or restored
    shm_reserve_bytes: int = 256 << 20  # shared memory a receive or restore leaves free
    max_connections: int = 64  # peer connections served at once
    max_connections_per_peer: int = 8  # of those, from one address
    max_fills: int = 2  # copies received or restored into shared memory at once
    job_uids: dict[str, int] = field(default_factory=dict)
    """The uid each job's ranks run as (its group: the same number); a job not listed
    runs as the keeper's own uid (one uid for everything)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Failed tier writes and catalog writes are retried with this backoff."""

    @property
    def node_dir(self) -> Path:
        return self.shm_root / self.node

    @property
    def socket_path(self) -> Path:
        return self.node_dir / "keeper.sock"


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
        return _map(paths.open_file(self.dir_fd, name, os.O_RDONLY), offset, size, path)


def _map(fd: int, offset: int, size: int, where: str) -> memoryview:
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


class Keeper:
    def __init__(self, bus: Bus, config: KeeperConfig) -> None:
        self.bus, self.cfg = bus, config
        self.node = config.node
        self.log = get_logger(component="keeper", node=self.node)
        self.memory: dict[tuple[str, int], MemCopy] = {}
        self.stores: dict[Tier, Store] = {}
        if config.disk_root is not None:
            self.stores[Tier.DISK] = DirTier(Tier.DISK, config.disk_root / self.node, fsync=config.fsync)
        if config.shared_root is not None:
            self.stores[Tier.SHARED] = DirTier(Tier.SHARED, config.shared_root, fsync=config.fsync)
        if config.object_url:
            self.stores[Tier.OBJECT] = ObjectTier(config.object_url)
        peerauth.check_key(config.key, "the keeper key (KeeperConfig.key, PHALANX_KEEPER_KEY)")
        self.catalog: Catalog | None = None
        self.addr = ""
        self._conns: dict[str, int] = {}  # peer address -> connections open
        self._fills = asyncio.Semaphore(config.max_fills)
        self._inflight = 0  # bytes of shared memory the fills under way will take
        self._server: asyncio.AbstractServer | None = None
        self._local: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._drain_lock = asyncio.Lock()  # one drain at a time: bounded interference with training
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._scanner: asyncio.Task[None] | None = None
        self._seen: set[tuple[str, int]] = set()  # (slot path hash, seq) taken
        self._scan_lock = asyncio.Lock()
        self._refused: dict[str, str] = {}  # path -> why, of what the scans refused (reported once)
        self._backlog: dict[str, Callable[[], Awaitable[None]]] = {}  # catalog writes to retry, by key
        self._backlog_task: asyncio.Task[None] | None = None
        self._load_locks: dict[tuple[str, int], tuple[asyncio.Lock, list[int]]] = {}  # lock, [users]
        self.counters = {
            "taken": 0,
            "replicated": 0,
            "received": 0,
            "drained": 0,
            "served": 0,
            "repaired": 0,
            "refused": 0,
            "skipped": 0,
            "retried": 0,
        }
        self.on_copy: Callable[[str, str, str, int, int], None] | None = None
        """Called with (job, tier, state, step, bytes) for every copy that changes state (metrics)."""

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.catalog = await Catalog.open(self.bus)
        await asyncio.to_thread(self._prepare_node_dir)
        self._server = await asyncio.start_server(
            self._serve_peer, self.cfg.host, self.cfg.port, limit=wire.PIECE
        )
        port = self._server.sockets[0].getsockname()[1]
        self.addr = f"{self.cfg.host}:{port}"
        await self.catalog.register_keeper(self.node, self.addr)
        await self._adopt()
        await self.scan_once()  # the slots adopted: taken again before any rank may ask
        # The ranks' socket last: a rank that finds it gets a keeper whose catalog is true.
        with contextlib.suppress(FileNotFoundError):
            self.cfg.socket_path.unlink()
        self._local = await asyncio.start_unix_server(
            self._serve_local, str(self.cfg.socket_path), limit=wire.PIECE
        )
        os.chmod(self.cfg.socket_path, 0o666)  # every job's ranks connect; SO_PEERCRED says who
        self._scanner = asyncio.create_task(self._scan_loop(), name="keeper-scan")
        self.log.info(
            "keeper_started",
            addr=self.addr,
            socket=str(self.cfg.socket_path),
            tiers=["memory", *[t.value for t in self.stores]],
            replicas=self.cfg.replicas,
        )

    def _prepare_node_dir(self) -> None:
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

    def _job_uid(self, job: str) -> int:
        """The uid the ranks of ``job`` run as (:attr:`KeeperConfig.job_uids`)."""
        return self.cfg.job_uids.get(job, os.geteuid())

    async def stop(self) -> None:
        if self._scanner is not None:
            self._scanner.cancel()
        for srv in (self._server, self._local):
            if srv is not None:
                srv.close()
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.cfg.socket_path.unlink()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._log_failure)
        return task

    def _log_failure(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.log.error("keeper_task_failed", task=task.get_name(), error=repr(task.exception()))

    async def idle(self, timeout_s: float = 120.0) -> None:
        """Wait until no take, replication or drain is in flight (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while any(
            not t.done()
            for t in self._tasks
            if t.get_name() != "keeper-peer" and not t.get_name().startswith("keeper-retry")
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"keeper {self.node} still busy after {timeout_s}s")
            await asyncio.sleep(0.02)

    # -- the catalog and events ------------------------------------------------------------
    async def _note(
        self,
        m: Manifest,
        tier: Tier,
        state: CopyState,
        *,
        node: str | None = None,
        seconds: float = 0.0,
        detail: str = "",
    ) -> None:
        catalog = self.catalog
        assert catalog is not None
        where = node or (self.node if tier in (Tier.MEMORY, Tier.DISK) else SHARED_NODE)
        key = f"{m.job}.{step_key(m.step)}.{tier.value}.{where}"
        if state == "deleted":
            await self._catalog_write(key, lambda: catalog.forget(m.job, m.step, tier, where))
        elif state not in ("served", "skipped"):
            await self._catalog_write(
                key, lambda: catalog.record(m.job, m.step, tier, where, state, m.total_bytes, self.addr)
            )
        try:
            event = CheckpointEvent(
                job=m.job,
                step=m.step,
                tier=tier.value,
                state=state,
                node=self.node,
                bytes=m.total_bytes,
                seconds=round(seconds, 4),
                detail=detail[:500],
            )
            await self.bus.publish(CHECKPOINT, event, job=m.job, retry_for_s=5.0)
        except Exception as exc:  # the bus being away must not stop a drain
            self.log.warning("event_unpublished", job=m.job, step=m.step, tier=tier.value, error=repr(exc))
        if self.on_copy is not None:
            self.on_copy(m.job, tier.value, state, m.step, m.total_bytes)
        self.log.info(
            "checkpoint",
            job=m.job,
            step=m.step,
            tier=tier.value,
            state=state,
            seconds=round(seconds, 3),
            detail=detail,
        )

    async def _catalog_write(self, key: str, write: Callable[[], Awaitable[None]]) -> None:
        """One catalog write. If the catalog is away it is kept (the latest per key) and
        retried in order, with :attr:`KeeperConfig.retry`'s backoff, until it is written:
        a copy is never left out of the catalog once KV is back."""
        if not self._backlog:
            try:
                await write()
                return
            except Exception as exc:
                self.log.warning("catalog_write_failed", key=key, error=repr(exc))
        self._backlog.pop(key, None)
        self._backlog[key] = write
        if self._backlog_task is None or self._backlog_task.done():
            self._backlog_task = self._spawn(self._flush_backlog(), "keeper-retry-catalog")

    async def _flush_backlog(self) -> None:
        attempt = 0
        while self._backlog:
            key, write = next(iter(self._backlog.items()))
            try:
                await write()
            except Exception as exc:
                self.log.info("catalog_write_retry", key=key, attempt=attempt, error=repr(exc))
                await asyncio.sleep(min(self.cfg.retry.delay(attempt), 30.0))
                attempt += 1
                continue
            if self._backlog.get(key) is write:
                del self._backlog[key]
            self.counters["retried"] += 1
            attempt = 0
        self.log.info("catalog_caught_up")

    # -- taking snapshots ------------------------------------------------------------------
    async def _scan_loop(self) -> None:
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
        found = await asyncio.to_thread(scan, self.cfg.shm_root, self.node, self._job_uid)
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
            self.counters["refused"] += 1
            self.log.error("slot_refused", path=path, reason=why)
            await self.bus.report_bad_input(f"slot {path}", DecodeError(f"{path}: {why}"[:4000], "slot"))

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
        old = self.memory.get((job, h.step))
        if old is not None:
            self._release(old)
        self.memory[(job, h.step)] = MemCopy(
            m, {"state.phx": (str(f.path), h.data_offset)}, slot=f, slot_seq=h.seq
        )
        self.counters["taken"] += 1
        await self._put_manifest(m)
        await self._note(m, Tier.MEMORY, COMPLETE, seconds=time.perf_counter() - t0)
        self._propagate(m)

    async def _put_manifest(self, m: Manifest) -> None:
        catalog = self.catalog
        assert catalog is not None
        await self._catalog_write(f"{m.job}.{step_key(m.step)}.manifest", lambda: catalog.put_manifest(m))

    async def register_directory(self, job: str, step: int, directory: Path, kind: Kind = "dcp") -> Manifest:
        """Adopt the files a writer left in ``directory`` (a DCP checkpoint) as a memory copy.

        ``directory`` must be ``<node>/dcp/<job>/<step:012d>``, every component a real
        directory (no symlink), ``dcp/<job>`` and the step's directory owned by the job's
        uid and not writable by everyone, every file in it a regular file of that uid
        with one link: a job registers its own files only (PermissionError otherwise)."""
        if directory != self.cfg.node_dir / "dcp" / job / step_key(step):
            raise PermissionError(
                f"{directory} is not {self.cfg.node_dir / 'dcp' / job / step_key(step)}: a job registers"
                " its own DCP directory of that step only"
            )
        uid = self._job_uid(job)

        def build() -> Manifest:
            with paths.dir_at(self.cfg.node_dir, "dcp", job) as job_fd:
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
                    view = _map(paths.open_file(fd, name, os.O_RDONLY), 0, st.st_size, str(directory / name))
                    entries.append(FileEntry(name=name, size=len(view), sha256=digest_chunks(view)))
                if not entries:
                    raise ManifestError(f"{directory}: no files to checkpoint")
                m = Manifest(
                    job=job, step=step, kind=kind, origin=self.node, created=time.time(), files=entries
                )
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                with open(paths.open_file(fd, MANIFEST_NAME, flags), "wb") as out:
                    out.write(m.encode())
                return m
            finally:
                os.close(fd)

        m = await asyncio.to_thread(build)
        self._adopt_memory(m, directory)
        await self._put_manifest(m)
        await self._note(m, Tier.MEMORY, COMPLETE)
        self._propagate(m)
        return m

    def _adopt_memory(self, m: Manifest, directory: Path) -> None:
        """``directory`` (under this node's directory, reached without symlinks) as the
        memory copy of ``m``; its files are read through a descriptor of it from now on."""
        dir_fd = paths.open_dir(self.cfg.node_dir, *directory.relative_to(self.cfg.node_dir).parts)
        old = self.memory.get((m.job, m.step))
        if old is not None:
            if old.directory != directory:
                self._release(old)
            elif old.dir_fd >= 0:
                os.close(old.dir_fd)
        self.memory[(m.job, m.step)] = MemCopy(
            m, {f.name: (str(directory / f.name), 0) for f in m.files}, directory=directory, dir_fd=dir_fd
        )

    # -- replication and drains ------------------------------------------------------------
    def _propagate(self, m: Manifest) -> None:
        key = (m.job, m.step)
        if key in self._pending and not self._pending[key].done():
            return
        self._pending[key] = self._spawn(self._propagate_now(m), f"keeper-propagate-{m.job}-{m.step}")

    async def _propagate_now(
        self,
        m: Manifest,
        tiers: tuple[Tier, ...] = DRAIN_ORDER,
        replicate: bool = True,
        force: bool = False,
        attempt: int = 0,
    ) -> None:
        """Replicate ``m`` and drain it to ``tiers`` in order. A tier that fails does not
        stop the later ones; the failed ones are tried again after
        :attr:`KeeperConfig.retry`'s backoff (``attempt``: how many times already)."""
        failed: list[Tier] = []
        with tracer.start_as_current_span("phalanx.checkpoint.propagate") as span:
            span.set_attribute("phalanx.job", m.job)
            span.set_attribute("phalanx.checkpoint.step", m.step)
            span.set_attribute("phalanx.checkpoint.bytes", m.total_bytes)
            replicas = (
                self._spawn(self._replicate(m), f"keeper-replicate-{m.job}-{m.step}") if replicate else None
            )
            async with self._drain_lock:
                for tier in tiers:
                    store = self.stores.get(tier)
                    if store is None:
                        continue
                    if not force and await self._holds(store, m):
                        continue  # already there (a keeper restarted after this drain)
                    source = self._reader(m)
                    if source is None:
                        self.log.warning("drain_source_gone", job=m.job, step=m.step, tier=tier.value)
                        failed.clear()  # nothing left here to drain from: no retry either
                        break
                    t0 = time.perf_counter()
                    try:
                        await asyncio.to_thread(store.put, m, source)
                    except Exception as exc:
                        await self._note(m, tier, "failed", detail=repr(exc))
                        failed.append(tier)
                        continue  # a full disk does not keep the checkpoint from the shared and object tiers
                    self.counters["drained"] += 1
                    await self._note(m, tier, COMPLETE, seconds=time.perf_counter() - t0)
                    await self._retain(m.job, tier)
            if replicas is not None:
                await replicas
            await self._retain(m.job, Tier.MEMORY)
        if failed:
            self._retry_later(m, tuple(failed), attempt, force)

    def _retry_later(self, m: Manifest, tiers: tuple[Tier, ...], attempt: int, force: bool) -> None:
        if self.cfg.retry.gives_up(attempt + 1):
            self.log.error(
                "drain_given_up", job=m.job, step=m.step, tiers=[t.value for t in tiers], attempts=attempt + 1
            )
            return
        delay = self.cfg.retry.delay(attempt)
        self.log.warning("drain_retry", job=m.job, step=m.step, tiers=[t.value for t in tiers], in_s=delay)

        async def later() -> None:
            await asyncio.sleep(delay)
            self.counters["retried"] += 1
            self._spawn(
                self._propagate_now(m, tiers, replicate=False, force=force, attempt=attempt + 1),
                f"keeper-propagate-{m.job}-{m.step}",
            )

        self._spawn(later(), f"keeper-retry-{m.job}-{m.step}")

    async def _holds(self, store: Store, m: Manifest) -> bool:
        listed = await self._listed(store, m.job)
        return any(x.step == m.step and x.files == m.files for x in listed or [])

    async def _listed(self, store: Store, job: str) -> list[Manifest] | None:
        """The manifests of ``job`` in ``store``; None (logged) when it cannot be listed:
        a listing error never aborts a drain, a retention pass or a restore."""
        try:
            return await asyncio.to_thread(store.manifests, job)
        except Exception as exc:  # obstore raises its own types
            self.log.warning("listing_failed", job=job, tier=store.tier.value, error=repr(exc))
            return None

    def _reader(self, m: Manifest) -> Callable[[str], memoryview] | None:
        mem = self.memory.get((m.job, m.step))
        if mem is not None:
            return mem.read
        disk = self.stores.get(Tier.DISK)
        if isinstance(disk, DirTier) and any(x.step == m.step for x in disk.manifests(m.job)):

            def read_verified(name: str) -> memoryview:
                data = disk.read(m, name)
                m.verify_file(name, data)  # a disk copy may have rotted since: never drained unchecked
                return data

            return read_verified
        return None

    async def _replicate(self, m: Manifest) -> None:
        if self.cfg.replicas < 1:
            return
        assert self.catalog is not None
        keepers = await self.catalog.keepers()
        ring = sorted(keepers)
        others = (
            [n for n in ring[ring.index(self.node) + 1 :] + ring[: ring.index(self.node)]]
            if self.node in ring
            else ring
        )
        done = 0
        for peer in others:
            if done >= self.cfg.replicas or peer == self.node:
                break
            t0 = time.perf_counter()
            try:
                await self._send(keepers[peer], m)
            except (OSError, wire.WireError, TimeoutError, ManifestError) as exc:
                self.log.warning("replicate_failed", job=m.job, step=m.step, peer=peer, error=repr(exc))
                continue
            done += 1
            self.counters["replicated"] += 1
            self.log.info(
                "replicated", job=m.job, step=m.step, peer=peer, seconds=round(time.perf_counter() - t0, 3)
            )
        if done < self.cfg.replicas:
            self.log.warning("replicas_short", job=m.job, step=m.step, wanted=self.cfg.replicas, made=done)

    async def _send(self, addr: str, m: Manifest) -> None:
        async with self._dial(addr) as (session, reader, writer):
            request = {"op": "replicate", "manifest": m.encode(), "from": self.node}
            await session.send(writer, request, self.cfg.io_timeout_s)
            deadline = self._deadline(m.total_bytes)
            mem = self.memory.get((m.job, m.step))
            for f in m.files:
                data = mem.read(f.name) if mem is not None else self._reader_or_fail(m)(f.name)
                await wire.write_bytes(writer, data, deadline)
            wire.checked(await session.recv(reader, self.cfg.io_timeout_s))

    @contextlib.asynccontextmanager
    async def _dial(
        self, addr: str
    ) -> AsyncIterator[tuple[peerauth.Session, asyncio.StreamReader, asyncio.StreamWriter]]:
        """An authenticated connection to the keeper at ``addr`` (``host:port``)."""
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), limit=wire.PIECE), self.cfg.connect_timeout_s
        )
        try:
            session = await peerauth.connect(reader, writer, self.cfg.key, self.cfg.auth_timeout_s)
            session.peer = addr
            yield session, reader, writer
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _deadline(self, nbytes: int) -> wire.Deadline:
        return wire.Deadline.for_bytes(nbytes, self.cfg.io_timeout_s, self.cfg.min_rate)

    def _reader_or_fail(self, m: Manifest) -> Callable[[str], memoryview]:
        r = self._reader(m)
        if r is None:
            raise ManifestError(f"{m.job}@{m.step}: no local copy left to read")
        return r

    # -- retention -------------------------------------------------------------------------
    async def _retain(self, job: str, tier: Tier) -> None:
        policy = self.cfg.retention.get(tier)
        if policy is None:
            return
        if tier is Tier.MEMORY:
            held = sorted(s for (j, s) in self.memory if j == job)
            for step in policy.expired(held):
                mem = self.memory[(job, step)]
                if not await self._durable_elsewhere(mem.manifest):
                    continue  # nothing else holds it yet: keep it in memory
                del self.memory[(job, step)]
                self._release(mem)
                await self._note(mem.manifest, Tier.MEMORY, "deleted")
            return
        store = self.stores.get(tier)
        if store is None:
            return
        listed = await self._listed(store, job)
        by_step = {m.step: m for m in listed or []}
        for step in policy.expired(list(by_step)):
            try:
                await asyncio.to_thread(store.delete, job, step)
            except Exception as exc:
                self.log.warning(
                    "retention_delete_failed", job=job, step=step, tier=tier.value, error=repr(exc)
                )
                continue
            await self._note(by_step[step], tier, "deleted")

    async def _durable_elsewhere(self, m: Manifest) -> bool:
        """Whether a durable copy of ``m`` exists: in a tier of this keeper, or -- what a
        received replica needs -- a complete disk, shared or object copy the catalog
        names on any node."""
        if not self.stores:
            return True  # memory is the only tier configured here: retention alone decides
        for store in self.stores.values():
            if any(x.step == m.step for x in await self._listed(store, m.job) or []):
                return True
        assert self.catalog is not None
        try:
            entry = (await self.catalog.entries(m.job)).get(m.step)
        except Exception as exc:
            self.log.warning("catalog_unreachable", job=m.job, step=m.step, error=repr(exc))
            return False
        return entry is not None and any(c.tier is not Tier.MEMORY for c in entry.complete())

    def _release(self, mem: MemCopy) -> None:
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

    # -- serving peers ---------------------------------------------------------------------
    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One peer connection: at most ``max_connections`` (``max_connections_per_peer`` from
        one address); the peer proves the keeper key within ``auth_timeout_s`` -- no thread,
        no allocation before that -- then asks for one thing."""
        task = asyncio.current_task()
        if task is not None:
            task.set_name("keeper-peer")
        name = writer.get_extra_info("peername")
        peer = str(name[0]) if isinstance(name, tuple) and name else "?"
        if (
            sum(self._conns.values()) >= self.cfg.max_connections
            or self._conns.get(peer, 0) >= self.cfg.max_connections_per_peer
        ):
            self.counters["peers_refused"] = self.counters.get("peers_refused", 0) + 1
            self.log.warning("peer_refused", peer=peer, error="too many connections")
            writer.close()
            return
        self._conns[peer] = self._conns.get(peer, 0) + 1
        try:
            try:
                session = await peerauth.accept(reader, writer, self.cfg.key, self.cfg.auth_timeout_s)
            except (wire.WireError, OSError) as exc:  # AuthError, a broken hello, a timeout
                self.counters["unauthenticated"] = self.counters.get("unauthenticated", 0) + 1
                self.log.warning("peer_unauthenticated", peer=peer, error=str(exc) or type(exc).__name__)
                return
            session.peer = peer
            try:
                req = await session.recv(reader, self.cfg.io_timeout_s)
                op = req.get("op")
                if op == "replicate":
                    await self._receive(session, req, reader, writer)
                elif op == "fetch":
                    await self._serve_fetch(session, req, writer)
                else:
                    raise wire.WireError(f"unknown op {str(op)[:40]!r}")
            except (wire.WireError, ValueError, OSError) as exc:
                self.log.warning("peer_refused", peer=peer, error=str(exc) or type(exc).__name__)
                with contextlib.suppress(Exception):
                    await session.send(
                        writer, {"ok": False, "error": str(exc)[:500]}, self.cfg.auth_timeout_s
                    )
        finally:
            self._conns[peer] -= 1
            if not self._conns[peer]:
                del self._conns[peer]
            writer.close()

    async def _committed(self, m: Manifest) -> None:
        """:class:`ManifestError` unless ``m`` is, byte for byte (its canonical encoding),
        the manifest committed in the catalog for its (job, step)."""
        assert self.catalog is not None
        committed = await self.catalog.manifest(m.job, m.step)
        if committed is None:
            raise ManifestError(f"{m.job}@{m.step}: the catalog has no manifest for it: refused")
        if committed.encode() != m.encode():
            raise ManifestError(f"{m.job}@{m.step}: not the manifest committed in the catalog: refused")

    async def _receive(
        self,
        session: peerauth.Session,
        req: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        raw = req.get("manifest")
        if not isinstance(raw, bytes):
            raise wire.WireError("replicate without a manifest")
        m = Manifest.parse(raw, f"manifest from {session.peer}")
        self._check_room(m)
        await self._committed(m)
        t0 = time.perf_counter()
        deadline = self._deadline(m.total_bytes)

        async def fill(f: FileEntry, at: int, into: memoryview) -> None:
            await wire.read_into(reader, into, deadline)

        directory = await self._fill(m, fill, "replicas")
        self.counters["received"] += 1
        self._adopt_memory(m, directory)
        # Recorded and retained in a task of the keeper's own (``idle`` waits for it), spawned
        # before the sender hears "ok": when the sender is idle, this keeper is busy or done.
        self._spawn(self._received(m, time.perf_counter() - t0), f"keeper-received-{m.job}-{m.step}")
        await session.send(writer, {"ok": True}, self.cfg.io_timeout_s)

    async def _received(self, m: Manifest, seconds: float) -> None:
        await self._note(m, Tier.MEMORY, COMPLETE, seconds=seconds, detail=f"replica of {m.origin}")
        await self._retain(m.job, Tier.MEMORY)

    def _check_room(self, m: Manifest) -> None:
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

    async def _fill(self, m: Manifest, fill: FillInto, kind: str) -> Path:
        """Files of ``m`` into ``<node>/<kind>/<job>/<step>/`` in shared memory, each chunk
        checked against its digest as it arrives (hashed in a thread while the next one
        is read), the manifest written last; returns the directory.

        Bounded: ``m`` must fit (:meth:`_check_room`); at most ``max_fills`` at once (one
        waits ``io_timeout_s`` for its turn, then is refused); ``fill`` bounds its own
        reads. The files are allocated whole first (``posix_fallocate``): filling a fresh
        tmpfs mapping page by page costs several times the copy itself."""
        self._check_room(m)
        try:
            await asyncio.wait_for(self._fills.acquire(), self.cfg.io_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{self.cfg.max_fills} copies are being filled already: busy") from None
        try:
            self._check_room(m)  # again: others may have filled meanwhile
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
        group = self.cfg.job_uids.get(m.job)
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

    async def _serve_fetch(
        self, session: peerauth.Session, req: dict[str, Any], writer: asyncio.StreamWriter
    ) -> None:
        job, step = req.get("job"), req.get("step")
        if not isinstance(job, str) or type(step) is not int:
            raise wire.WireError("fetch needs a job (str) and a step (int)")
        found = await self._local_copy(job, step)
        if found is None:
            await session.send(writer, {"ok": False, "error": f"{job}@{step} is not on {self.node}"}, 5.0)
            return
        m, where = found
        await self._committed(m)
        await session.send(writer, {"ok": True, "manifest": m.encode()}, self.cfg.io_timeout_s)
        deadline = self._deadline(m.total_bytes)
        loop = asyncio.get_running_loop()
        for f in m.files:
            path, offset = where[f.name]
            if not f.size:
                continue
            with open(path, "rb") as src:  # sendfile: the bytes go from the page cache to the socket
                await asyncio.wait_for(
                    loop.sendfile(writer.transport, src, offset, f.size),
                    max(0.0, deadline.end - time.monotonic()),
                )
        self.counters["served"] += 1

    async def _local_copy(self, job: str, step: int) -> tuple[Manifest, dict[str, tuple[str, int]]] | None:
        """A good copy of ``job@step`` on this node (memory, then a verified disk copy):
        its manifest and each file's (path, offset), or None."""
        mem = self.memory.get((job, step))
        if mem is not None and mem.intact():
            return mem.manifest, mem.files
        disk = self.stores.get(Tier.DISK)
        if isinstance(disk, DirTier):
            for m in await asyncio.to_thread(disk.manifests, job):
                if m.step == step:
                    if await self._verified(m, (lambda mm: lambda name: disk.read(mm, name))(m), Tier.DISK):
                        where = disk.path(job, step)
                        return m, {f.name: (str(where / f.name), 0) for f in m.files}
        return None

    async def _verified(self, m: Manifest, read: Callable[[str], memoryview], tier: Tier) -> bool:
        def check() -> str:
            try:
                for f in m.files:
                    m.verify_file(f.name, read(f.name))
            except (ManifestError, OSError) as exc:
                return str(exc)
            return ""

        problem = await asyncio.to_thread(check)
        if problem:
            await self._note(m, tier, "corrupt", detail=problem)
            return False
        return True

    # -- serving ranks ---------------------------------------------------------------------
    async def _serve_local(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req = await wire.read_frame(reader, timeout_s=self.cfg.io_timeout_s)
            op, job = req.get("op"), req.get("job")
            if not isinstance(job, str) or not job:
                raise wire.WireError("a request needs its job")
            try:
                self._check_caller(writer, job)  # a process speaks for its own job only
            except PermissionError as exc:
                self.log.error("caller_refused", op=str(op)[:32], job=job[:64], error=str(exc))
                raise
            if op == "list":
                reply = {"ok": True, "checkpoints": await self.checkpoints(job)}
            elif op == "load":
                step = req.get("step")
                if step is not None and type(step) is not int:
                    raise wire.WireError("step must be an int or absent")
                reply = await self.load(job, step)
            elif op == "register":
                step, directory = req.get("step"), req.get("dir")
                if type(step) is not int or step < 0 or not isinstance(directory, str):
                    raise wire.WireError("register needs a step (int >= 0) and a dir")
                try:
                    m = await self.register_directory(job, step, Path(directory))
                except OSError as exc:
                    self.log.error("register_refused", job=job, step=step, dir=directory, error=str(exc))
                    raise
                reply = {"ok": True, "manifest": m.encode()}
            elif op == "skipped":
                step, reason = req.get("step"), req.get("reason")
                if type(step) is not int or step < 0 or not isinstance(reason, str):
                    raise wire.WireError("skipped needs a step (int >= 0) and a reason")
                await self.skipped(job, step, f"{req.get('worker')!s:.64}: {reason:.400}")
                reply = {"ok": True}
            else:
                raise wire.WireError(f"unknown op {op!r}")
        except (wire.WireError, ManifestError, OSError, ValueError, TimeoutError) as exc:
            reply = {"ok": False, "error": str(exc)[:1000]}
        try:
            await wire.write_frame(writer, reply)
        finally:
            writer.close()

    def _check_caller(self, writer: asyncio.StreamWriter, job: str) -> None:
        """PermissionError unless the process at the other end of this Unix socket
        (``SO_PEERCRED``) runs as ``job``'s uid (or as root)."""
        sock = writer.get_extra_info("socket")
        pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid not in (0, self._job_uid(job)):
            raise PermissionError(
                f"pid {pid} runs as uid {uid}, not as job {job!r}'s uid {self._job_uid(job)}"
            )

    async def skipped(self, job: str, step: int, why: str) -> None:
        """A rank skipped a save (every slot held, or no room in shared memory): an event
        (``state="skipped"``) and a metric, no catalog entry."""
        self.counters["skipped"] += 1
        self.log.warning("checkpoint_skipped", job=job, step=step, detail=why)
        if self.on_copy is not None:
            self.on_copy(job, Tier.MEMORY.value, "skipped", step, 0)
        event = CheckpointEvent(
            job=job,
            step=step,
            tier=Tier.MEMORY.value,
            state="skipped",
            node=self.node,
            bytes=0,
            detail=why[:500],
        )
        try:
            await self.bus.publish(CHECKPOINT, event, job=job, retry_for_s=5.0)
        except Exception as exc:
            self.log.warning("event_unpublished", job=job, step=step, error=repr(exc))

    async def checkpoints(self, job: str) -> list[dict[str, Any]]:
        """Every checkpoint of ``job`` with a complete copy somewhere, newest first."""
        assert self.catalog is not None
        entries = await self.catalog.entries(job)
        out = []
        for step in sorted(entries, reverse=True):
            e = entries[step]
            if e.manifest is None or not e.complete():
                continue
            m = e.manifest
            out.append(
                {"step": step, "bytes": m.total_bytes, "kind": m.kind, "origin": m.origin, "tiers": e.tiers()}
            )
        return out

    async def load(self, job: str, step: int | None) -> dict[str, Any]:
        """Make a verified copy of ``job@step`` (None: the newest there is) available in this
        node's memory; the reply names its files and the tier that served it."""
        assert self.catalog is not None
        with tracer.start_as_current_span("phalanx.checkpoint.restore") as span:
            span.set_attribute("phalanx.job", job)
            entries = await self.catalog.entries(job)
            candidates = sorted((s for s, e in entries.items() if e.manifest and e.complete()), reverse=True)
            if step is not None:
                candidates = [s for s in candidates if s == step]
            for s in candidates:
                e = entries[s]
                t0 = time.perf_counter()
                async with self._bringing(job, s):  # one fill of a step at a time
                    got = await self._bring(e)
                if got is None:
                    continue
                tier, mem, fetched = got
                seconds = time.perf_counter() - t0
                span.set_attribute("phalanx.checkpoint.step", s)
                span.set_attribute("phalanx.checkpoint.tier", tier)
                await self._note(mem.manifest, Tier.MEMORY, "served", seconds=seconds, detail=f"from {tier}")
                self.counters["served"] += 1
                return {
                    "ok": True,
                    "manifest": mem.manifest.encode(),
                    "files": {n: [p, o] for n, (p, o) in mem.files.items()},
                    "tier": tier,
                    "seconds": seconds,
                    "fetched_bytes": fetched,  # read from the serving tier (0: this node's memory)
                }
            what = f"step {step}" if step is not None else "any checkpoint"
            span.set_attribute("phalanx.checkpoint.tier", "none")
            return {
                "ok": False,
                "error": f"no complete copy of {what} of job {job!r} could be read",
                "missing": True,
            }

    @contextlib.asynccontextmanager
    async def _bringing(self, job: str, step: int) -> AsyncIterator[None]:
        """Held while a restore of ``job@step`` brings it into memory: two loads of one
        step never fill (or release) its copy at the same time."""
        lock, users = self._load_locks.setdefault((job, step), (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._load_locks[(job, step)]

    async def _bring(self, e: Entry) -> tuple[str, MemCopy, int] | None:
        """A verified memory copy of ``e`` on this node, where it came from, and how many
        bytes were read there."""
        assert e.manifest is not None
        m, key = e.manifest, (e.job, e.step)
        mem = self.memory.get(key)
        if mem is not None:
            if mem.intact() and mem.manifest.encode() == m.encode():  # the catalog's, not another
                return "memory", mem, 0
            del self.memory[key]
            self._release(mem)
        damaged: list[Tier] = []
        disk = self.stores.get(Tier.DISK)
        if disk is not None and any(x.step == e.step for x in await self._listed(disk, e.job) or []):
            got = await self._bring_from(m, disk)
            if got is not None:
                return "disk", got, m.total_bytes
            await self._note(m, Tier.DISK, "corrupt", detail="failed its checksums on restore")
            damaged.append(Tier.DISK)
        assert self.catalog is not None
        keepers = await self.catalog.keepers()
        peers = sorted(
            {c.node for c in e.complete() if c.tier in (Tier.MEMORY, Tier.DISK) and c.node != self.node}
        )
        for peer in peers:
            if peer not in keepers:
                continue
            try:
                got = await self._fetch(keepers[peer], m)
            except (OSError, wire.WireError, TimeoutError, ManifestError) as exc:
                self.log.warning("peer_fetch_failed", job=e.job, step=e.step, peer=peer, error=repr(exc))
                continue
            self._repair(m, damaged)
            return "peer", got, m.total_bytes
        for tier in (Tier.SHARED, Tier.OBJECT):
            store = self.stores.get(tier)
            if store is None or not any(c.tier is tier for c in e.complete()):
                continue
            before = getattr(store, "bytes_read", 0)
            got = await self._bring_from(m, store)
            if got is not None:
                self._repair(m, damaged)
                fetched = getattr(store, "bytes_read", 0) - before if tier is Tier.OBJECT else m.total_bytes
                return tier.value, got, fetched
            await self._note(m, tier, "corrupt", detail="failed its checksums on restore")
            damaged.append(tier)
        return None

    async def _bring_from(self, m: Manifest, store: Store) -> MemCopy | None:
        async def fill(f: FileEntry, at: int, into: memoryview) -> None:
            # each chunk read straight into its place (an object in ranges): no file whole in RAM
            await asyncio.to_thread(store.read_into, m, f.name, into, at)

        try:
            directory = await self._fill(m, fill, "restored")
        except (ManifestError, OSError) as exc:
            self.log.warning("restore_copy_bad", job=m.job, step=m.step, error=str(exc))
            return None
        except Exception as exc:  # an object store error (obstore raises its own types)
            self.log.warning("restore_copy_failed", job=m.job, step=m.step, error=repr(exc))
            return None
        self._adopt_memory(m, directory)
        return self.memory[(m.job, m.step)]

    async def _fetch(self, addr: str, m: Manifest) -> MemCopy:
        """``m`` (the catalog's manifest) from the peer keeper at ``addr``, into this
        node's shared memory, each chunk checked against ``m``'s digests as it arrives."""
        async with self._dial(addr) as (session, reader, writer):
            await session.send(writer, {"op": "fetch", "job": m.job, "step": m.step}, self.cfg.io_timeout_s)
            reply = wire.checked(await session.recv(reader, self.cfg.io_timeout_s))
            theirs = Manifest.parse(reply.get("manifest") or b"", f"manifest from {addr}")
            if theirs.encode() != m.encode():
                raise ManifestError(f"{addr} holds another {m.job}@{m.step} than the catalog's")
            deadline = self._deadline(m.total_bytes)

            async def fill(f: FileEntry, at: int, into: memoryview) -> None:
                await wire.read_into(reader, into, deadline)

            directory = await self._fill(m, fill, "restored")
        self._adopt_memory(m, directory)
        return self.memory[(m.job, m.step)]

    def _repair(self, m: Manifest, damaged: list[Tier]) -> None:
        if damaged:
            self.counters["repaired"] += 1
            self._spawn(
                self._propagate_now(m, tuple(damaged), replicate=False, force=True),
                f"keeper-repair-{m.job}-{m.step}",
            )

    # -- after a restart -------------------------------------------------------------------
    async def _adopt(self) -> None:
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
                    self._adopt_memory(m, d)
                except (OSError, ManifestError) as exc:
                    self.log.info("shm_copy_removed", directory=str(d), reason=str(exc))
                    with contextlib.suppress(OSError):
                        paths.rmtree_at(self.cfg.node_dir, kind, job, name)
                    continue
                await self._note(m, Tier.MEMORY, COMPLETE, detail="adopted after a restart")
        # Complete copies on this node's disk: list them again; resume their drains.
        disk = self.stores.get(Tier.DISK)
        if isinstance(disk, DirTier):
            for job in disk.jobs():
                removed = disk.clean_partials(job)
                if removed:
                    self.log.info("partials_removed", job=job, tier="disk", count=removed)
                for m in disk.manifests(job):
                    held.add((m.job, m.step, Tier.DISK))
                    await self._note(m, Tier.DISK, COMPLETE, detail="adopted after a restart")
                    if m.origin == self.node:
                        self._spawn(self._resume(m), f"keeper-resume-{m.job}-{m.step}")
        # What the catalog says this node holds and it does not (a node that came back
        # without its memory, or its disk): those copies are gone.
        held |= {(j, st, Tier.MEMORY) for (j, st) in self.memory}
        assert self.catalog is not None
        for job, step, tier in await self.catalog.copies_on(self.node):
            if (job, step, tier) not in held:
                await self.catalog.forget(job, step, tier, self.node)
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

    async def _resume(self, m: Manifest) -> None:
        missing = []
        for tier in (Tier.SHARED, Tier.OBJECT):
            store = self.stores.get(tier)
            if store is not None:
                listed = await self._listed(store, m.job)
                if listed is None or not any(x.step == m.step for x in listed):
                    missing.append(tier)
        if missing:
            self.log.info("drain_resumed", job=m.job, step=m.step, tiers=[t.value for t in missing])
            await self._propagate_now(m, tuple(missing), replicate=False)

    def health(self) -> dict[str, str | int | float | bool]:
        return {"addr": self.addr, "memory_copies": len(self.memory), **self.counters}
