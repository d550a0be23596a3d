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
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace

from phalanx.bus import Bus
from phalanx.bus.subjects import CHECKPOINT
from phalanx.checkpoint import wire
from phalanx.checkpoint.catalog import COMPLETE, SHARED_NODE, Catalog, Entry
from phalanx.checkpoint.manifest import MANIFEST_NAME, FileEntry, Kind, Manifest, ManifestError, crc_chunks
from phalanx.checkpoint.slots import SlotFile, SlotState, scan
from phalanx.checkpoint.tiers import DRAIN_ORDER, DirTier, ObjectTier, RetentionPolicy, Store, Tier, step_key
from phalanx.schemas import CheckpointEvent
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

    def intact(self) -> bool:
        """Still what was verified when it was taken or received (a slot not rewritten
        since, a directory not removed). Memory copies are not checksummed again on
        every read: that would double a restore from memory."""
        if self.slot is not None:
            h = self.slot.header()
            return h.seq == self.slot_seq and h.state is SlotState.HELD
        return self.directory is not None and all(Path(p).exists() for p, _ in self.files.values())

    def read(self, name: str) -> memoryview:
        path, offset = self.files[name]
        size = self.manifest.file(name).size
        if self.slot is not None:
            h = self.slot.header()
            if h.seq != self.slot_seq or h.state is not SlotState.HELD:
                raise ManifestError(f"{path}: the slot was rewritten (seq {h.seq}, {h.state.name})")
            return memoryview(self.slot.map)[offset : offset + size]
        return _map(Path(path), offset, size)


def _map(path: Path, offset: int, size: int) -> memoryview:
    if size == 0:
        return memoryview(b"")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < offset + size:
            raise ManifestError(f"{path}: shorter than the manifest says")
        return memoryview(mmap.mmap(f.fileno(), offset + size, prot=mmap.PROT_READ))[offset:]


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
        self.catalog: Catalog | None = None
        self.addr = ""
        self._server: asyncio.AbstractServer | None = None
        self._local: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._drain_lock = asyncio.Lock()  # one drain at a time: bounded interference with training
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._scanner: asyncio.Task[None] | None = None
        self._seen: set[tuple[str, int]] = set()  # (slot path hash, seq) taken
        self.counters = {"taken": 0, "replicated": 0, "received": 0, "drained": 0, "served": 0, "repaired": 0}
        self.on_copy: Callable[[str, str, str, int, int], None] | None = None
        """Called with (job, tier, state, step, bytes) for every copy that changes state (metrics)."""

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.catalog = await Catalog.open(self.bus)
        self.cfg.node_dir.mkdir(parents=True, exist_ok=True)
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
        self._scanner = asyncio.create_task(self._scan_loop(), name="keeper-scan")
        self.log.info(
            "keeper_started",
            addr=self.addr,
            socket=str(self.cfg.socket_path),
            tiers=["memory", *[t.value for t in self.stores]],
            replicas=self.cfg.replicas,
        )

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
        while any(not t.done() for t in self._tasks if t.get_name() != "keeper-peer"):
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
        assert self.catalog is not None
        where = node or (self.node if tier in (Tier.MEMORY, Tier.DISK) else SHARED_NODE)
        try:
            if state == "deleted":
                await self.catalog.forget(m.job, m.step, tier, where)
            elif state != "served":
                await self.catalog.record(m.job, m.step, tier, where, state, m.total_bytes, self.addr)
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
            self.log.warning("catalog_unreachable", job=m.job, step=m.step, tier=tier.value, error=repr(exc))
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

    # -- taking snapshots ------------------------------------------------------------------
    async def _scan_loop(self) -> None:
        while True:
            try:
                await self.scan_once()
            except Exception as exc:
                self.log.error("scan_failed", error=repr(exc))
            await asyncio.sleep(self.cfg.scan_s)

    async def scan_once(self) -> None:
        for job, f in scan(self.cfg.shm_root, self.node):
            h = f.header()
            if h.state is SlotState.READY and (str(f.path), h.seq) not in self._seen:
                self._seen.add((str(f.path), h.seq))
                await self._take(job, f)
            else:
                f.close()

    async def _take(self, job: str, f: SlotFile) -> None:
        h = f.header()
        t0 = time.perf_counter()
        data = f.data(h)
        crcs = await asyncio.to_thread(crc_chunks, data)
        del data
        try:
            m = Manifest(
                job=job,
                step=h.step,
                kind="snapshot",
                origin=self.node,
                created=h.written_at,
                files=[FileEntry(name="state.phx", size=h.data_len, crc32=crcs)],
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
        assert self.catalog is not None
        await self.catalog.put_manifest(m)
        await self._note(m, Tier.MEMORY, COMPLETE, seconds=time.perf_counter() - t0)
        self._propagate(m)

    async def register_directory(self, job: str, step: int, directory: Path, kind: Kind = "dcp") -> Manifest:
        """Adopt the files a writer left in ``directory`` (a DCP checkpoint) as a memory copy."""
        files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
        if not files:
            raise ManifestError(f"{directory}: no files to checkpoint")

        def build() -> Manifest:
            entries = []
            for p in files:
                view = _map(p, 0, p.stat().st_size)
                entries.append(
                    FileEntry(name=str(p.relative_to(directory)), size=len(view), crc32=crc_chunks(view))
                )
            return Manifest(
                job=job, step=step, kind=kind, origin=self.node, created=time.time(), files=entries
            )

        m = await asyncio.to_thread(build)
        (directory / MANIFEST_NAME).write_bytes(m.encode())
        self._adopt_memory(m, directory)
        assert self.catalog is not None
        await self.catalog.put_manifest(m)
        await self._note(m, Tier.MEMORY, COMPLETE)
        self._propagate(m)
        return m

    def _adopt_memory(self, m: Manifest, directory: Path) -> None:
        old = self.memory.get((m.job, m.step))
        if old is not None and old.directory != directory:
            self._release(old)
        self.memory[(m.job, m.step)] = MemCopy(
            m, {f.name: (str(directory / f.name), 0) for f in m.files}, directory=directory
        )

    # -- replication and drains ------------------------------------------------------------
    def _propagate(self, m: Manifest) -> None:
        key = (m.job, m.step)
        if key in self._pending and not self._pending[key].done():
            return
        self._pending[key] = self._spawn(self._propagate_now(m), f"keeper-propagate-{m.job}-{m.step}")

    async def _propagate_now(
        self, m: Manifest, tiers: tuple[Tier, ...] = DRAIN_ORDER, replicate: bool = True, force: bool = False
    ) -> None:
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
                        break
                    t0 = time.perf_counter()
                    try:
                        await asyncio.to_thread(store.put, m, source)
                    except Exception as exc:
                        await self._note(m, tier, "failed", detail=repr(exc))
                        break
                    self.counters["drained"] += 1
                    await self._note(m, tier, COMPLETE, seconds=time.perf_counter() - t0)
                    await self._retain(m.job, tier)
            if replicas is not None:
                await replicas
            await self._retain(m.job, Tier.MEMORY)

    async def _holds(self, store: Store, m: Manifest) -> bool:
        listed = await asyncio.to_thread(store.manifests, m.job)
        return any(x.step == m.step and x.files == m.files for x in listed)

    def _reader(self, m: Manifest) -> Callable[[str], memoryview] | None:
        mem = self.memory.get((m.job, m.step))
        if mem is not None:
            return mem.read
        disk = self.stores.get(Tier.DISK)
        if disk is not None and any(x.step == m.step for x in disk.manifests(m.job)):
            return lambda name: disk.read(m, name)
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
        host, _, port = addr.rpartition(":")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), limit=wire.PIECE), self.cfg.connect_timeout_s
        )
        try:
            await wire.write_frame(writer, {"op": "replicate", "manifest": m.encode(), "from": self.node})
            mem = self.memory.get((m.job, m.step))
            for f in m.files:
                data = mem.read(f.name) if mem is not None else self._reader_or_fail(m)(f.name)
                await wire.write_bytes(writer, data)
            wire.checked(await asyncio.wait_for(wire.read_frame(reader), 120.0))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

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
        listed = await asyncio.to_thread(store.manifests, job)
        by_step = {m.step: m for m in listed}
        for step in policy.expired(list(by_step)):
            await asyncio.to_thread(store.delete, job, step)
            await self._note(by_step[step], tier, "deleted")

    async def _durable_elsewhere(self, m: Manifest) -> bool:
        if not self.stores:
            return True  # memory is the only tier configured: retention alone decides
        for tier, store in self.stores.items():
            listed = await asyncio.to_thread(store.manifests, m.job)
            if any(x.step == m.step for x in listed):
                return True
            del tier
        return False

    def _release(self, mem: MemCopy) -> None:
        if mem.slot is not None:
            h = mem.slot.header()
            if h.seq == mem.slot_seq and h.state is SlotState.HELD:
                mem.slot.set_state(SlotState.FREE)
            mem.slot.close()
        elif mem.directory is not None:
            shutil.rmtree(mem.directory, ignore_errors=True)

    # -- serving peers ---------------------------------------------------------------------
    async def _serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            task.set_name("keeper-peer")
        try:
            req = await wire.read_frame(reader)
            op = req.get("op")
            if op == "replicate":
                await self._receive(req, reader, writer)
            elif op == "fetch":
                await self._serve_fetch(req, writer)
            else:
                await wire.write_frame(writer, {"ok": False, "error": f"unknown op {op!r}"})
        except (wire.WireError, ManifestError, OSError) as exc:
            self.log.warning("peer_refused", error=str(exc))
            with contextlib.suppress(Exception):
                await wire.write_frame(writer, {"ok": False, "error": str(exc)[:500]})
        finally:
            writer.close()

    async def _receive(
        self, req: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        raw = req.get("manifest")
        if not isinstance(raw, bytes):
            raise wire.WireError("replicate without a manifest")
        m = Manifest.parse(raw, f"manifest from {req.get('from')!r}")
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()

        def fill(f: Any, into: memoryview) -> None:
            asyncio.run_coroutine_threadsafe(wire.read_into(reader, into), loop).result()

        directory = await asyncio.to_thread(self._fill, m, fill, "replicas")
        self.counters["received"] += 1
        await wire.write_frame(writer, {"ok": True})
        await self._note(
            m, Tier.MEMORY, COMPLETE, seconds=time.perf_counter() - t0, detail=f"replica of {m.origin}"
        )
        self._adopt_memory(m, directory)
        await self._retain(m.job, Tier.MEMORY)

    def _fill(self, m: Manifest, fill: Callable[[Any, memoryview], None], kind: str) -> Path:
        """Files of ``m`` into ``<node>/<kind>/<job>/<step>/`` in shared memory, verified,
        the manifest written last; returns the directory. Blocking: run it in a thread.

        The files are allocated whole first (``posix_fallocate``): filling a fresh
        tmpfs mapping page by page costs several times the copy itself."""
        final = self.cfg.node_dir / kind / m.job / step_key(m.step)
        tmp = final.parent / f".partial-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for f in m.files:
                path = tmp / f.name
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "w+b") as out:
                    if f.size:
                        os.posix_fallocate(out.fileno(), 0, f.size)
                        mm = mmap.mmap(out.fileno(), f.size)
                        try:
                            view = memoryview(mm)
                            fill(f, view)
                            got = crc_chunks(view, m.chunk)
                            view.release()
                        finally:
                            mm.close()
                        if got != f.crc32:
                            raise ManifestError(f"{m.job}@{m.step}/{f.name}: checksum mismatch on arrival")
            (tmp / MANIFEST_NAME).write_bytes(m.encode())
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    async def _serve_fetch(self, req: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        job, step = req.get("job"), req.get("step")
        if not isinstance(job, str) or type(step) is not int:
            raise wire.WireError("fetch needs a job (str) and a step (int)")
        found = await self._local_copy(job, step)
        if found is None:
            await wire.write_frame(writer, {"ok": False, "error": f"{job}@{step} is not on {self.node}"})
            return
        m, where = found
        await wire.write_frame(writer, {"ok": True, "manifest": m.encode()})
        loop = asyncio.get_running_loop()
        for f in m.files:
            path, offset = where[f.name]
            with open(path, "rb") as src:  # sendfile: the bytes go from the page cache to the socket
                await loop.sendfile(writer.transport, src, offset, f.size)
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
            req = await wire.read_frame(reader)
            op, job = req.get("op"), req.get("job")
            if not isinstance(job, str) or not job:
                raise wire.WireError("a request needs its job")
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
                d = Path(directory).resolve()
                if not d.is_relative_to(self.cfg.node_dir.resolve()):
                    raise wire.WireError(f"{d} is not under this node's shared memory {self.cfg.node_dir}")
                m = await self.register_directory(job, step, d)
                reply = {"ok": True, "manifest": m.encode()}
            else:
                raise wire.WireError(f"unknown op {op!r}")
        except (wire.WireError, ManifestError, OSError) as exc:
            reply = {"ok": False, "error": str(exc)[:1000]}
        try:
            await wire.write_frame(writer, reply)
        finally:
            writer.close()

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

    async def _bring(self, e: Entry) -> tuple[str, MemCopy, int] | None:
        """A verified memory copy of ``e`` on this node, where it came from, and how many
        bytes were read there."""
        assert e.manifest is not None
        m, key = e.manifest, (e.job, e.step)
        mem = self.memory.get(key)
        if mem is not None:
            if mem.intact():
                return "memory", mem, 0
            del self.memory[key]
            self._release(mem)
        damaged: list[Tier] = []
        disk = self.stores.get(Tier.DISK)
        if disk is not None and any(x.step == e.step for x in await asyncio.to_thread(disk.manifests, e.job)):
            got = await self._bring_from(m, lambda name: disk.read(m, name))
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
            got = await self._bring_from(m, (lambda st: lambda name: st.read(m, name))(store))
            if got is not None:
                self._repair(m, damaged)
                fetched = getattr(store, "bytes_read", 0) - before if tier is Tier.OBJECT else m.total_bytes
                return tier.value, got, fetched
            await self._note(m, tier, "corrupt", detail="failed its checksums on restore")
            damaged.append(tier)
        return None

    async def _bring_from(self, m: Manifest, read: Callable[[str], memoryview]) -> MemCopy | None:
        def fill(f: Any, into: memoryview) -> None:
            data = read(f.name)
            if len(data) != f.size:
                raise ManifestError(
                    f"{m.job}@{m.step}/{f.name}: {len(data)} bytes, the manifest says {f.size}"
                )
            into[:] = data

        try:
            directory = await asyncio.to_thread(self._fill, m, fill, "restored")
        except (ManifestError, OSError) as exc:
            self.log.warning("restore_copy_bad", job=m.job, step=m.step, error=str(exc))
            return None
        except Exception as exc:  # an object store error (obstore raises its own types)
            self.log.warning("restore_copy_failed", job=m.job, step=m.step, error=repr(exc))
            return None
        self._adopt_memory(m, directory)
        return self.memory[(m.job, m.step)]

    async def _fetch(self, addr: str, m: Manifest) -> MemCopy:
        """``m`` from the peer keeper at ``addr``, received straight into this node's
        shared memory (a blocking socket in a thread: no stream buffer in between)."""
        host, _, port = addr.rpartition(":")

        def transfer() -> Path:
            with socket.create_connection((host, int(port)), timeout=self.cfg.connect_timeout_s) as s:
                s.settimeout(120.0)
                s.sendall(wire.encode_frame({"op": "fetch", "job": m.job, "step": m.step}))
                reply = wire.checked(wire.recv_frame(s))
                theirs = Manifest.parse(reply.get("manifest") or b"", f"manifest from {addr}")
                if theirs.files != m.files:
                    raise ManifestError(f"{addr} holds another {m.job}@{m.step} than the catalog's")
                return self._fill(m, lambda f, into: wire.recv_into(s, into), "restored")

        directory = await asyncio.to_thread(transfer)
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
        # Slots a previous keeper held: hold them again (READY ones the scan takes).
        for job, f in scan(self.cfg.shm_root, self.node):
            h = f.header()
            if h.state is SlotState.HELD:
                f.set_state(SlotState.READY)  # taken again: checksummed and propagated as new
            if h.state in (SlotState.HELD, SlotState.READY):
                held.add((job, h.step, Tier.MEMORY))
            f.close()
        # Replicas and restored copies in shared memory.
        for kind in ("replicas", "restored"):
            base = self.cfg.node_dir / kind
            for d in sorted(base.glob("*/*")) if base.is_dir() else []:
                if d.name.startswith(".partial-"):
                    shutil.rmtree(d, ignore_errors=True)
                    continue
                try:
                    m = Manifest.parse((d / MANIFEST_NAME).read_bytes(), str(d))
                except (OSError, ManifestError):
                    shutil.rmtree(d, ignore_errors=True)
                    continue
                self._adopt_memory(m, d)
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

    async def _resume(self, m: Manifest) -> None:
        missing = []
        for tier in (Tier.SHARED, Tier.OBJECT):
            store = self.stores.get(tier)
            if store is not None:
                listed = await asyncio.to_thread(store.manifests, m.job)
                if not any(x.step == m.step for x in listed):
                    missing.append(tier)
        if missing:
            self.log.info("drain_resumed", job=m.job, step=m.step, tiers=[t.value for t in missing])
            await self._propagate_now(m, tuple(missing), replicate=False)

    def health(self) -> dict[str, str | int | float | bool]:
        return {"addr": self.addr, "memory_copies": len(self.memory), **self.counters}
