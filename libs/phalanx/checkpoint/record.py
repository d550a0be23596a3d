"""What a keeper records about each copy: the catalog entry (KV, retried in order while
the catalog is away), a :class:`CheckpointEvent`, a log line, a counter and a metric."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from phalanx.bus import Bus
from phalanx.checkpoint.catalog import REPLICAS, SHARED_NODE, Catalog, ReplicasShort
from phalanx.checkpoint.keepertasks import KeeperTasks
from phalanx.checkpoint.manifest import Manifest, ManifestError, job_of
from phalanx.checkpoint.tiers import RetryPolicy, Tier, step_key
from phalanx.contract import CheckpointEvent
from phalanx.contract.messages import CopyState
from phalanx.contract.subjects import CHECKPOINT


class Recorder:
    """The catalog (opened on :meth:`open`) and the record of every copy's state."""

    def __init__(self, bus: Bus, node: str, retry: RetryPolicy, tasks: KeeperTasks, log: Any) -> None:
        self.bus, self.node, self.retry, self.tasks, self.log = bus, node, retry, tasks, log
        self._catalog: Catalog | None = None
        self.addr = ""  # where peers reach this keeper, once it serves them
        self._backlog: dict[str, Callable[[], Awaitable[None]]] = {}  # catalog writes to retry, by key
        self._backlog_task: asyncio.Task[None] | None = None
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
            "replicas_short": 0,
        }
        self.on_copy: Callable[[str, str, str, int, int], None] | None = None
        """Called with (job, tier, state, step, bytes) for every copy that changes state (metrics)."""
        self.on_replicas: Callable[[str, str, int], None] | None = None
        """Called with (job, checkpoint, missing) -- ``checkpoint`` is ``<job or part>@<step>``
        -- whenever the replicas a checkpoint of this keeper misses change (metrics); 0 once
        they exist, or are no longer sought."""
        self.replicas_missing: dict[tuple[str, int], int] = {}
        """(job, step) -> replicas missing, for each checkpoint of this keeper short of them."""
        self.taken_over: dict[tuple[str, int], str] = {}
        """(job, step) -> the lost origin whose drain this keeper finishes
        (:mod:`phalanx.checkpoint.takeover`): its shared and object copies say so."""

    async def open(self) -> Catalog:
        self._catalog = await Catalog.open(self.bus)
        return self._catalog

    @property
    def catalog(self) -> Catalog:
        assert self._catalog is not None, "the keeper has not started"
        return self._catalog

    async def note(
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
        where = node or (self.node if tier in (Tier.MEMORY, Tier.DISK) else SHARED_NODE)
        key = f"{m.job}.{step_key(m.step)}.{tier.value}.{where}"
        if state == "deleted":
            await self._catalog_write(key, lambda: catalog.forget(m.job, m.step, tier, where))
        elif state not in ("served", "skipped"):
            await self._catalog_write(
                key,
                lambda: catalog.record(
                    m.job, m.step, tier, where, state, m.total_bytes, self.addr, by=self.node
                ),
            )
        origin = self.taken_over.get((m.job, m.step))
        if origin is not None and tier in (Tier.SHARED, Tier.OBJECT) and not detail:
            detail = f"drain taken over from {origin}"
        # A part of a DCP set is published (and counted) under its job, the part named in
        # ``detail``: events and metrics are per job, not per rank.
        job = job_of(m.job)
        if job != m.job:
            detail = f"part {m.job}" + (f": {detail}" if detail else "")
        try:
            event = CheckpointEvent(
                job=job,
                step=m.step,
                tier=tier.value,
                state=state,
                node=self.node,
                bytes=m.total_bytes,
                seconds=round(seconds, 4),
                detail=detail[:500],
            )
            await self.bus.publish(CHECKPOINT, event, job=job, retry_for_s=5.0)
        except Exception as exc:  # the bus being away must not stop a drain
            self.log.warning("event_unpublished", job=m.job, step=m.step, tier=tier.value, error=repr(exc))
        if self.on_copy is not None:
            self.on_copy(job, tier.value, state, m.step, m.total_bytes)
        self.log.info(
            "checkpoint",
            job=m.job,
            step=m.step,
            tier=tier.value,
            state=state,
            seconds=round(seconds, 3),
            detail=detail,
        )

    async def put_manifest(self, m: Manifest) -> None:
        catalog = self.catalog
        await self._catalog_write(f"{m.job}.{step_key(m.step)}.manifest", lambda: catalog.put_manifest(m))

    async def committed(self, m: Manifest) -> None:
        """:class:`ManifestError` unless ``m`` is, byte for byte (its canonical encoding),
        the manifest committed in the catalog for its (job, step)."""
        committed = await self.catalog.manifest(m.job, m.step)
        if committed is None:
            raise ManifestError(f"{m.job}@{m.step}: the catalog has no manifest for it: refused")
        if committed.encode() != m.encode():
            raise ManifestError(f"{m.job}@{m.step}: not the manifest committed in the catalog: refused")

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

    async def replicas_short(self, m: Manifest, short: ReplicasShort) -> None:
        """``m`` has fewer peer replicas than wanted: its catalog record (``phalanx ckpt
        show`` says so), a ``failed`` memory event naming what is missing, a log line and
        the metric. Said again whenever that changes (another peer reached, another error)."""
        first = (m.job, m.step) not in self.replicas_missing
        if first:
            self.counters["replicas_short"] += 1
        self._replicas_metric(m, short.missing)
        catalog = self.catalog
        await self._catalog_write(
            f"{m.job}.{step_key(m.step)}.{REPLICAS}", lambda: catalog.replicas_short(m.job, m.step, short)
        )
        detail = (
            f"replicas missing: {short.missing} of {short.wanted} (made on: {', '.join(short.made) or 'none'};"
            f" {short.error}); retried with backoff"
        )
        self.log.warning(
            "replicas_short",
            job=m.job,
            step=m.step,
            wanted=short.wanted,
            made=list(short.made),
            error=short.error,
        )
        await self._publish(m, "failed", detail)

    async def replicas_settled(self, m: Manifest, why: str) -> None:
        """``m``'s replicas are no longer missing (``why``: they exist, or the checkpoint is
        gone from this node): its catalog record deleted, the metric back to 0."""
        if self.replicas_missing.get((m.job, m.step)) is None:
            return
        self._replicas_metric(m, 0)
        catalog = self.catalog
        await self._catalog_write(
            f"{m.job}.{step_key(m.step)}.{REPLICAS}", lambda: catalog.replicas_made(m.job, m.step)
        )
        self.log.info("replicas_settled", job=m.job, step=m.step, detail=why)

    def _replicas_metric(self, m: Manifest, missing: int) -> None:
        if missing:
            self.replicas_missing[(m.job, m.step)] = missing
        else:
            self.replicas_missing.pop((m.job, m.step), None)
        if self.on_replicas is not None:
            self.on_replicas(job_of(m.job), f"{m.job}@{m.step}", missing)

    async def _publish(self, m: Manifest, state: CopyState, detail: str) -> None:
        """A memory-tier event about ``m`` (under its job: a part is named in ``detail``)
        that is no copy's state change: no catalog record of a copy."""
        job = job_of(m.job)
        if job != m.job:
            detail = f"part {m.job}: {detail}"
        event = CheckpointEvent(
            job=job,
            step=m.step,
            tier=Tier.MEMORY.value,
            state=state,
            node=self.node,
            bytes=m.total_bytes,
            detail=detail[:500],
        )
        try:
            await self.bus.publish(CHECKPOINT, event, job=job, retry_for_s=5.0)
        except Exception as exc:
            self.log.warning("event_unpublished", job=m.job, step=m.step, error=repr(exc))

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
            self._backlog_task = self.tasks.spawn(self._flush_backlog(), "keeper-retry-catalog")

    async def _flush_backlog(self) -> None:
        attempt = 0
        while self._backlog:
            key, write = next(iter(self._backlog.items()))
            try:
                await write()
            except Exception as exc:
                self.log.info("catalog_write_retry", key=key, attempt=attempt, error=repr(exc))
                await asyncio.sleep(min(self.retry.delay(attempt), 30.0))
                attempt += 1
                continue
            if self._backlog.get(key) is write:
                del self._backlog[key]
            self.counters["retried"] += 1
            attempt = 0
        self.log.info("catalog_caught_up")
