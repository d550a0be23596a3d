"""Propagating a checkpoint from this node: replicated to peers (short of them: retried,
:mod:`~phalanx.checkpoint.replicas`) while it drains to the
durable tiers its step goes to (:meth:`KeeperConfig.drain_tiers`), in the lanes of
:class:`~phalanx.checkpoint.drainplan.DrainPlan` -- by default the object store
streamed from the memory copy beside the disk and then the shared path -- each lane one
checkpoint at a time, in threads of lower priority, each tier paced to its rate cap;
each tier's retention is applied after its copy; a tier that fails is retried with
backoff."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from opentelemetry import trace

from phalanx.checkpoint.catalog import COMPLETE
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.keepertasks import KeeperTasks
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.replicas import Replicas
from phalanx.checkpoint.tiers import Tier

tracer = trace.get_tracer("phalanx.checkpoint")


class Drains:
    def __init__(
        self,
        cfg: KeeperConfig,
        holdings: Holdings,
        replicas: Replicas,
        rec: Recorder,
        tasks: KeeperTasks,
        log: Any,
    ) -> None:
        self.cfg, self.holdings, self.replicas = cfg, holdings, replicas
        self.rec, self.tasks, self.log = rec, tasks, log
        plan = cfg.drain
        self._lanes = [asyncio.Lock() for _ in plan.lanes]  # one checkpoint per lane at a time
        self._pool = ThreadPoolExecutor(
            max_workers=len(plan.lanes), thread_name_prefix="keeper-drain", initializer=plan.lower_priority
        )
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
        for tier in (t for t in self.cfg.drain_tiers(m.step) if t in (Tier.SHARED, Tier.OBJECT)):
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
        tiers: tuple[Tier, ...] | None = None,
        replicate: bool = True,
        force: bool = False,
        attempt: int = 0,
    ) -> None:
        """Replicate ``m`` and drain it to ``tiers`` (None: those its step goes to), the
        lanes side by side. A tier that fails does not stop the later ones; the failed
        ones are tried again after :attr:`KeeperConfig.retry`'s backoff (``attempt``:
        how many times already)."""
        todo = self.cfg.drain_tiers(m.step) if tiers is None else tiers
        plan = self.cfg.drain
        with tracer.start_as_current_span("phalanx.checkpoint.propagate") as span:
            span.set_attribute("phalanx.job", m.job)
            span.set_attribute("phalanx.checkpoint.step", m.step)
            span.set_attribute("phalanx.checkpoint.bytes", m.total_bytes)
            replicas = (
                self.tasks.spawn(self.replicas.make(m), f"keeper-replicate-{m.job}-{m.step}")
                if replicate
                else None
            )
            lanes = [tuple(t for t in lane if t in todo) for lane in plan.lanes]
            failed = await asyncio.gather(
                *(self._lane(i, lane, m, force) for i, lane in enumerate(lanes) if lane)
            )
            if replicas is not None:
                await replicas
            await self.holdings.retain(m.job, Tier.MEMORY)
        again = tuple(t for lane in failed for t in lane)
        if again:
            self._retry_later(m, again, attempt, force)

    async def _lane(self, i: int, tiers: tuple[Tier, ...], m: Manifest, force: bool) -> list[Tier]:
        """Drain ``m`` to ``tiers`` in order (lane ``i``, one checkpoint at a time);
        returns the tiers that failed."""
        failed: list[Tier] = []
        done: list[Tier] = []
        holdings = self.holdings
        async with self._lanes[i]:
            for tier in tiers:
                store = holdings.stores.get(tier)
                if store is None:
                    continue
                if not force and await holdings.holds(store, m):
                    continue  # already there (a keeper restarted after this drain)
                source = holdings.reader(m)
                if source is None:
                    self.log.warning("drain_source_gone", job=m.job, step=m.step, tier=tier.value)
                    return []  # nothing left here to drain from: no retry either
                throttle = self.cfg.drain.throttle(tier)
                t0 = time.perf_counter()
                try:
                    await asyncio.get_running_loop().run_in_executor(
                        self._pool, store.put, m, source, None if throttle is None else throttle.pace
                    )
                except Exception as exc:
                    await self.rec.note(m, tier, "failed", detail=repr(exc))
                    failed.append(tier)
                    continue  # a full disk does not keep the checkpoint from the later tiers
                self.rec.counters["drained"] += 1
                paced = f"paced {throttle.slept_s:.2f} s" if throttle is not None and throttle.slept_s else ""
                await self.rec.note(m, tier, COMPLETE, seconds=time.perf_counter() - t0, detail=paced)
                done.append(tier)
        for tier in done:  # out of the lane: the next checkpoint's copy does not wait for deletes
            await holdings.retain(m.job, tier)
        return failed

    def close(self) -> None:
        """Stop the drain threads (what they run is abandoned: a restart resumes it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

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
