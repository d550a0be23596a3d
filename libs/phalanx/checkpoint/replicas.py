"""The peer replicas of each checkpoint this keeper takes: made while it drains, and,
when a peer could not take one, tried again until they exist.

A checkpoint short of its ``replicas`` (every peer unreachable, refused, or too few
keepers registered) is *reported* -- a ``replicas`` record in the catalog that
``phalanx ckpt show`` prints, a ``failed`` memory event naming what is missing, the
``phalanx_checkpoint_replicas_missing`` metric (:meth:`Recorder.replicas_short`) --
and *retried* with :attr:`KeeperConfig.retry`'s backoff, each attempt on the ring of
keepers registered then (a peer that joined or came back is used; one that holds a
replica already is not sent another). The retries end, and the report is withdrawn,
when the replicas exist or when this node no longer holds the checkpoint in memory
(memory's retention released it: superseded, and durable; or an operator removed it):
a guarantee that a node's loss loses no checkpoint does not go away silently."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from phalanx.checkpoint.catalog import ReplicasShort
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.keepertasks import KeeperTasks
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.replication import Replicator


class Replicas:
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
        self._retrying: dict[tuple[str, int], asyncio.Task[None]] = {}

    async def make(self, m: Manifest) -> None:
        """Replicate ``m`` (its first attempt, part of its propagation); short of
        ``replicas``: reported, and retried in a task of its own."""
        if self.cfg.replicas < 1:
            return
        made, error = await self._attempt(m, ())
        key = (m.job, m.step)
        if len(made) >= self.cfg.replicas:
            if key in self._retrying:  # made again (a re-adopted checkpoint): the retries are moot
                self._retrying[key].cancel()
            await self.rec.replicas_settled(m, f"made on {', '.join(made)}")
            return
        short = ReplicasShort(self.cfg.replicas, tuple(made), error, self.cfg.node, since=time.time())
        await self.rec.replicas_short(m, short)
        if key not in self._retrying:  # (one already retrying goes on from what it has)
            self._retrying[key] = self.tasks.spawn(
                self._retry(m, short), f"keeper-retry-replicas-{m.job}-{m.step}"
            )

    async def _retry(self, m: Manifest, short: ReplicasShort) -> None:
        attempt = 0
        try:
            while short.missing:
                if self.cfg.retry.gives_up(attempt + 1):
                    self.log.error("replicas_given_up", job=m.job, step=m.step, attempts=attempt + 1)
                    return  # the report stays: they are still missing
                await asyncio.sleep(self.cfg.retry.delay(attempt))
                attempt += 1
                if not self._held(m):
                    await self.rec.replicas_settled(m, "no longer held here (released or removed)")
                    return
                made, error = await self._attempt(m, short.made)
                self.rec.counters["retried"] += 1
                before, short = short, replace(short, made=short.made + tuple(made), error=error)
                if short.missing and short != before:  # reported again only when it changed
                    await self.rec.replicas_short(m, short)
            await self.rec.replicas_settled(m, f"made on {', '.join(short.made)}")
        finally:
            self._retrying.pop((m.job, m.step), None)

    async def _attempt(self, m: Manifest, have: tuple[str, ...]) -> tuple[list[str], str]:
        """One round of :meth:`Replicator.replicate`; a catalog that cannot list the
        keepers is this round's error, not the end of the retries."""
        try:
            return await self.replicator.replicate(m, have)
        except Exception as exc:
            self.log.warning("replicate_failed", job=m.job, step=m.step, error=repr(exc))
            return [], repr(exc)

    def _held(self, m: Manifest) -> bool:
        """Whether this node still holds ``m`` in memory (the copy replicas are sent from)."""
        mem = self.holdings.shm.copies.get((m.job, m.step))
        return mem is not None and mem.manifest.created == m.created
