"""What this node's keeper holds of a checkpoint, tier by tier: listing the tiers, reading
a local copy (memory, else a verified disk copy), and retention (which copies to drop)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import Manifest, ManifestError
from phalanx.checkpoint.memcopy import SharedMemory
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.tiers import DirTier, ObjectTier, Store, Tier

Files = dict[str, tuple[str, int]]
"""Each file of a copy: name -> (path, offset)."""


class Holdings:
    """This node's tiers: its shared memory and the stores configured (disk, shared, object)."""

    def __init__(self, cfg: KeeperConfig, shm: SharedMemory, rec: Recorder, log: Any) -> None:
        self.cfg, self.shm, self.rec, self.log = cfg, shm, rec, log
        self.stores: dict[Tier, Store] = {}
        if cfg.disk_root is not None:
            self.stores[Tier.DISK] = DirTier(Tier.DISK, cfg.disk_root / cfg.node, fsync=cfg.fsync)
        if cfg.shared_root is not None:
            self.stores[Tier.SHARED] = DirTier(Tier.SHARED, cfg.shared_root, fsync=cfg.fsync)
        if cfg.object_url:
            self.stores[Tier.OBJECT] = ObjectTier(
                cfg.object_url,
                part_bytes=cfg.drain.object_part_bytes,
                concurrency=cfg.drain.object_concurrency,
            )

    async def listed(self, store: Store, job: str) -> list[Manifest] | None:
        """The manifests of ``job`` in ``store``; None (logged) when it cannot be listed:
        a listing error never aborts a drain, a retention pass or a restore."""
        try:
            return await asyncio.to_thread(store.manifests, job)
        except Exception as exc:  # obstore raises its own types
            self.log.warning("listing_failed", job=job, tier=store.tier.value, error=repr(exc))
            return None

    async def holds(self, store: Store, m: Manifest) -> bool:
        listed = await self.listed(store, m.job)
        return any(x.step == m.step and x.files == m.files for x in listed or [])

    def reader(self, m: Manifest) -> Callable[[str], memoryview] | None:
        """Reads each file of ``m`` from this node: its memory copy, else its disk copy
        (verified on every read); None when neither is here."""
        mem = self.shm.copies.get((m.job, m.step))
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

    def reader_or_fail(self, m: Manifest) -> Callable[[str], memoryview]:
        r = self.reader(m)
        if r is None:
            raise ManifestError(f"{m.job}@{m.step}: no local copy left to read")
        return r

    async def local_copy(self, job: str, step: int) -> tuple[Manifest, Files] | None:
        """A good copy of ``job@step`` on this node (memory, then a verified disk copy):
        its manifest and each file's (path, offset), or None."""
        mem = self.shm.copies.get((job, step))
        if mem is not None and mem.intact():
            return mem.manifest, mem.files
        disk = self.stores.get(Tier.DISK)
        if isinstance(disk, DirTier):
            for m in await asyncio.to_thread(disk.manifests, job):
                if m.step == step:
                    if await self.verified(m, (lambda mm: lambda name: disk.read(mm, name))(m), Tier.DISK):
                        where = disk.path(job, step)
                        return m, {f.name: (str(where / f.name), 0) for f in m.files}
        return None

    async def verified(self, m: Manifest, read: Callable[[str], memoryview], tier: Tier) -> bool:
        def check() -> str:
            try:
                for f in m.files:
                    m.verify_file(f.name, read(f.name))
            except (ManifestError, OSError) as exc:
                return str(exc)
            return ""

        problem = await asyncio.to_thread(check)
        if problem:
            await self.rec.note(m, tier, "corrupt", detail=problem)
            return False
        return True

    # -- retention -------------------------------------------------------------------------
    async def retain(self, job: str, tier: Tier) -> None:
        """Drop what ``tier``'s retention (:attr:`KeeperConfig.retention`) no longer keeps
        of ``job``. A memory copy goes only once a durable copy exists, unless its step is
        one no durable tier takes (:meth:`KeeperConfig.drain_tiers`: ``disk:every=200``
        and step 150): that one is released by memory's retention alone, since newer
        checkpoints (``last``) are complete in memory. So memory holds its ``last`` and,
        besides, each durable-bound checkpoint not yet durable: the newest durable-bound
        checkpoint is never released before it is durable."""
        policy = self.cfg.retention.get(tier)
        if policy is None:
            return
        if tier is Tier.MEMORY:
            memory = self.shm.copies
            held = sorted(s for (j, s) in memory if j == job)
            for step in policy.expired(held):
                mem = memory.get((job, step))
                if mem is None:
                    continue  # released meanwhile (an operator's removal)
                if self.cfg.drain_tiers(step) and not await self._durable_elsewhere(mem.manifest):
                    continue  # bound for a durable tier that does not hold it yet: keep it in memory
                if memory.get((job, step)) is not mem:
                    continue  # released (or replaced) while the catalog was asked
                del memory[(job, step)]
                self.shm.release(mem)
                await self.rec.note(mem.manifest, Tier.MEMORY, "deleted")
            return
        store = self.stores.get(tier)
        if store is None:
            return
        listed = await self.listed(store, job)
        by_step = {m.step: m for m in listed or []}
        for step in policy.expired(list(by_step)):
            try:
                await asyncio.to_thread(store.delete, job, step)
            except Exception as exc:
                self.log.warning(
                    "retention_delete_failed", job=job, step=step, tier=tier.value, error=repr(exc)
                )
                continue
            await self.rec.note(by_step[step], tier, "deleted")

    async def _durable_elsewhere(self, m: Manifest) -> bool:
        """Whether a durable copy of ``m`` exists: in a tier of this keeper, or -- what a
        received replica needs -- a complete disk, shared or object copy the catalog
        names on any node."""
        if not self.stores:
            return True  # memory is the only tier configured here: retention alone decides
        for store in self.stores.values():
            if any(x.step == m.step for x in await self.listed(store, m.job) or []):
                return True
        catalog = self.rec.catalog
        try:
            entry = (await catalog.entries(m.job)).get(m.step)
        except Exception as exc:
            self.log.warning("catalog_unreachable", job=m.job, step=m.step, error=repr(exc))
            return False
        return entry is not None and any(c.tier is not Tier.MEMORY for c in entry.complete())
