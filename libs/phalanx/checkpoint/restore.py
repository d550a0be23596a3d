"""Restoring a checkpoint for a rank of this node: the newest complete checkpoint (or the
asked step) brought into this node's memory from the first tier holding a good copy --
its own memory, its disk, a peer, the shared path, the object store -- a copy that fails
its checksums reported corrupt and rewritten from the good one."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import trace

import phalanx.checkpoint.wire as wire
from phalanx.checkpoint.catalog import Entry
from phalanx.checkpoint.drains import Drains
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.manifest import FileEntry, Manifest, ManifestError
from phalanx.checkpoint.memcopy import MemCopy
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.replication import Replicator
from phalanx.checkpoint.tiers import Store, Tier

tracer = trace.get_tracer("phalanx.checkpoint")


class Restorer:
    def __init__(
        self, holdings: Holdings, replicator: Replicator, drains: Drains, rec: Recorder, log: Any
    ) -> None:
        self.holdings, self.replicator, self.drains, self.rec, self.log = (
            holdings,
            replicator,
            drains,
            rec,
            log,
        )
        self.shm = holdings.shm
        self.node = holdings.cfg.node
        self._load_locks: dict[tuple[str, int], tuple[asyncio.Lock, list[int]]] = {}  # lock, [users]

    async def checkpoints(self, job: str) -> list[dict[str, Any]]:
        """Every checkpoint of ``job`` with a complete copy somewhere, newest first."""
        entries = await self.rec.catalog.entries(job)
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
        catalog = self.rec.catalog
        with tracer.start_as_current_span("phalanx.checkpoint.restore") as span:
            span.set_attribute("phalanx.job", job)
            entries = await catalog.entries(job)
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
                await self.rec.note(
                    mem.manifest, Tier.MEMORY, "served", seconds=seconds, detail=f"from {tier}"
                )
                self.rec.counters["served"] += 1
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
        mem = self.shm.copies.get(key)
        if mem is not None:
            if mem.intact() and mem.manifest.encode() == m.encode():  # the catalog's, not another
                return "memory", mem, 0
            del self.shm.copies[key]
            self.shm.release(mem)
        damaged: list[Tier] = []
        disk = self.holdings.stores.get(Tier.DISK)
        if disk is not None and any(x.step == e.step for x in await self.holdings.listed(disk, e.job) or []):
            got = await self._bring_from(m, disk)
            if got is not None:
                return "disk", got, m.total_bytes
            await self.rec.note(m, Tier.DISK, "corrupt", detail="failed its checksums on restore")
            damaged.append(Tier.DISK)
        keepers = await self.rec.catalog.keepers()
        peers = sorted(
            {c.node for c in e.complete() if c.tier in (Tier.MEMORY, Tier.DISK) and c.node != self.node}
        )
        for peer in peers:
            if peer not in keepers:
                continue
            try:
                got = await self.replicator.fetch(keepers[peer], m)
            except (OSError, wire.WireError, TimeoutError, ManifestError) as exc:
                self.log.warning("peer_fetch_failed", job=e.job, step=e.step, peer=peer, error=repr(exc))
                continue
            self.drains.repair(m, damaged)
            return "peer", got, m.total_bytes
        for tier in (Tier.SHARED, Tier.OBJECT):
            store = self.holdings.stores.get(tier)
            if store is None or not any(c.tier is tier for c in e.complete()):
                continue
            before = getattr(store, "bytes_read", 0)
            got = await self._bring_from(m, store)
            if got is not None:
                self.drains.repair(m, damaged)
                fetched = getattr(store, "bytes_read", 0) - before if tier is Tier.OBJECT else m.total_bytes
                return tier.value, got, fetched
            await self.rec.note(m, tier, "corrupt", detail="failed its checksums on restore")
            damaged.append(tier)
        return None

    async def _bring_from(self, m: Manifest, store: Store) -> MemCopy | None:
        async def fill(f: FileEntry, at: int, into: memoryview) -> None:
            # each chunk read straight into its place (an object in ranges): no file whole in RAM
            await asyncio.to_thread(store.read_into, m, f.name, into, at)

        try:
            directory = await self.shm.fill(m, fill, "restored")
        except (ManifestError, OSError) as exc:
            self.log.warning("restore_copy_bad", job=m.job, step=m.step, error=str(exc))
            return None
        except Exception as exc:  # an object store error (obstore raises its own types)
            self.log.warning("restore_copy_failed", job=m.job, step=m.step, error=repr(exc))
            return None
        return self.shm.adopt(m, directory)
