"""Propagating a checkpoint from this node: replicated to peers while it drains, one
checkpoint at a time, to ``disk``, then ``shared``, then ``object`` (each configured),
with each tier's retention applied after; a tier that fails is retried with backoff."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from opentelemetry import trace

from phalanx.checkpoint.catalog import COMPLETE
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.keepertasks import KeeperTasks
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.replication import Replicator
from phalanx.checkpoint.tiers import DRAIN_ORDER, Tier

tracer = trace.get_tracer("phalanx.checkpoint")


class Drains:
    def __init__(
        self,
        cfg: KeeperConfig,
        holdings: Holdings,
        replicator: Replicator,
        rec: Recorder,
        tasks: KeeperTasks,
        log: Any,
    ) -> None:
        self.cfg, self.holdings, self.replicator = cfg, holdings, replicator
        self.rec, self.tasks, self.log = rec, tasks, log
        self._lock = asyncio.Lock()  # one drain at a time: bounded interference with training
        self._pending: dict[tuple[str, int], asyncio.Task[None]] = {}

    def propagate(self, m: Manifest) -> None:
        """Replicate and drain ``m`` in a task (one per checkpoint at a time)."""
        key = (m.job, m.step)
        if key in self._pending and not self._pending[key].done():
            return
        self._pending[key] = self.tasks.spawn(self.propagate_now(m), f"keeper-propagate-{m.job}-{m.step}")

    def repair(self, m: Manifest, damaged: list[Tier]) -> None:
        """Rewrite ``m`` to the ``damaged`` tiers (their copies failed their checksums)."""
        if damaged:
            self.rec.counters["repaired"] += 1
            self.tasks.spawn(
                self.propagate_now(m, tuple(damaged), replicate=False, force=True),
                f"keeper-repair-{m.job}-{m.step}",
            )

    async def resume(self, m: Manifest) -> None:
        """Finish the drain of ``m`` (on this node's disk) a previous keeper left unfinished."""
        missing = []
        for tier in (Tier.SHARED, Tier.OBJECT):
            store = self.holdings.stores.get(tier)
            if store is not None:
                listed = await self.holdings.listed(store, m.job)
                if listed is None or not any(x.step == m.step for x in listed):
                    missing.append(tier)
        if missing:
            self.log.info("drain_resumed", job=m.job, step=m.step, tiers=[t.value for t in missing])
            await self.propagate_now(m, tuple(missing), replicate=False)

    async def propagate_now(
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
        holdings = self.holdings
        with tracer.start_as_current_span("phalanx.checkpoint.propagate") as span:
            span.set_attribute("phalanx.job", m.job)
            span.set_attribute("phalanx.checkpoint.step", m.step)
            span.set_attribute("phalanx.checkpoint.bytes", m.total_bytes)
            replicas = (
                self.tasks.spawn(self.replicator.replicate(m), f"keeper-replicate-{m.job}-{m.step}")
                if replicate
                else None
            )
            async with self._lock:
                for tier in tiers:
                    store = holdings.stores.get(tier)
                    if store is None:
                        continue
                    if not force and await holdings.holds(store, m):
                        continue  # already there (a keeper restarted after this drain)
                    source = holdings.reader(m)
                    if source is None:
                        self.log.warning("drain_source_gone", job=m.job, step=m.step, tier=tier.value)
                        failed.clear()  # nothing left here to drain from: no retry either
                        break
                    t0 = time.perf_counter()
                    try:
                        await asyncio.to_thread(store.put, m, source)
                    except Exception as exc:
                        await self.rec.note(m, tier, "failed", detail=repr(exc))
                        failed.append(tier)
                        continue  # a full disk does not keep the checkpoint from the shared and object tiers
                    self.rec.counters["drained"] += 1
                    await self.rec.note(m, tier, COMPLETE, seconds=time.perf_counter() - t0)
                    await holdings.retain(m.job, tier)
            if replicas is not None:
                await replicas
            await holdings.retain(m.job, Tier.MEMORY)
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
            self.rec.counters["retried"] += 1
            self.tasks.spawn(
                self.propagate_now(m, tiers, replicate=False, force=force, attempt=attempt + 1),
                f"keeper-propagate-{m.job}-{m.step}",
            )

        self.tasks.spawn(later(), f"keeper-retry-{m.job}-{m.step}")
