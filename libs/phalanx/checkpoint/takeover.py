"""Drain takeover: a keeper finishes the drain of a checkpoint whose origin keeper is lost.

A snapshot is drained to the shared and object tiers by its origin's keeper alone
(:mod:`~phalanx.checkpoint.drains`). When that node dies mid-drain, its replicas still
serve restores, but nobody would write the durable copies. So every keeper, every
:attr:`KeeperConfig.refresh_s`:

1. **refreshes its registration** ``=keeper.<node>`` (a new ``at``) in the catalog:
   that is its heartbeat. A keeper is *lost* when its registration is older than
   :attr:`KeeperConfig.lost_after_s` (several refresh periods; missing counts as
   old) *and* nothing answers a TCP connect on its registered address (within
   ``connect_timeout_s``). The connect keeps a keeper that cannot reach NATS, or
   whose clock runs behind, from being taken for dead; the stale registration keeps
   a port that happens to answer from mattering unless the keeper also stopped
   refreshing. (The failure detector's verdicts are per job; keepers are per node.)
2. **picks what to take over** (:func:`orphaned`, pure): each checkpoint this keeper
   holds in its shared memory (a replica, or a restored copy) whose manifest's
   ``origin`` is a lost keeper, whose manifest is the one committed in the catalog
   (and not removed by an operator), and whose copy in a tier this keeper has
   configured and the tier policy sends that step to (:meth:`KeeperConfig.drain_tiers`)
   -- ``shared`` and ``object`` only: the lost node's disk is not ours to rebuild --
   is not complete in the catalog.
3. **claims it, exactly once**, by a KV create of ``<job>.<step:012d>.takeover``
   (``{"node", "origin", "state": "draining", "at"}``): of the keepers holding a
   replica, the one whose create lands first drains it; the others see the key and
   leave it. A claim whose claimer is itself lost (by the same test) is taken over by
   a compare-and-set on the claim's revision, so again only one keeper wins it; a
   keeper that finds its own ``draining`` claim (it restarted) renews it the same way.
   A ``done`` claim is never taken again.
4. **drains it** through the ordinary path, :meth:`Drains.propagate_now` with the
   missing tiers and ``replicate=False`` (it reads this keeper's memory copy, takes
   the drain lock, records each copy and retries a failed tier with backoff). A tier
   the origin had finished but not yet recorded is found by listing it, and recorded.
   Once every missing tier holds the copy, the claim is marked ``done``.

What the catalog then shows: the shared/object copy record's ``by`` is the node that
drained it (every record carries its writer's node), the ``takeover`` key names the
claimer and the origin (:attr:`Entry.takeover`), the ``complete`` CheckpointEvents
of those tiers come from the claimer with ``detail="drain taken over from <origin>"``,
and the keeper logs ``drain_taken_over`` and counts ``taken_over``.

Costs: each period one KV put (the registration) and, while this keeper holds copies
from other nodes, one KV get per origin; the catalog is read further only when one of
them is stale, and a connect is tried only then.

Limits: "exactly once" is among the keepers that take over. An origin cut off from
NATS and from its peers (a partition, not a death) looks lost and may still finish
its own drain, and a lost keeper that comes back may resume its drain from disk
(:meth:`Drains.resume`) while the claimer writes the same tier: the tier then gets the
same verified bytes twice, nothing is lost or wrong. An origin that comes back empty
(alive, its memory and disk gone) is not lost, so nobody finishes its drain. Claim
keys stay in the catalog after their checkpoint is deleted (one small key per
takeover).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from phalanx.bus import Conflict
from phalanx.checkpoint.catalog import COMPLETE, DONE, Entry, Registration
from phalanx.checkpoint.drains import Drains
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.keepertasks import KeeperTasks
from phalanx.checkpoint.manifest import Manifest
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.tiers import Tier

TAKEOVER_TIERS = (Tier.SHARED, Tier.OBJECT)
"""The tiers a keeper finishes for another: one copy for every node."""

Key = tuple[str, int]  # (job, step)


def stale(
    registrations: Mapping[str, Registration], nodes: Iterable[str], now: float, bound_s: float
) -> dict[str, str]:
    """Of ``nodes``, those whose registration is older than ``bound_s`` at ``now`` (or
    missing), each with the address to probe ("" when there is none)."""
    out: dict[str, str] = {}
    for node in nodes:
        reg = registrations.get(node)
        if reg is None:
            out[node] = ""
        elif now - reg.at > bound_s:
            out[node] = reg.addr
    return out


def orphaned(
    node: str,
    held: Iterable[Manifest],
    lost: Collection[str],
    entries: Mapping[Key, Entry],
    tiers_for: Callable[[int], Sequence[Tier]],
) -> list[tuple[Manifest, tuple[Tier, ...]]]:
    """What keeper ``node``, holding ``held`` in memory, should finish draining: each
    checkpoint whose origin is in ``lost`` (never ``node`` itself), whose catalog entry
    commits that very manifest, has no ``done`` takeover and was not removed, with those of
    ``tiers_for(step)`` the catalog has no complete copy in. Newest first (the one a
    restart wants)."""
    out: list[tuple[Manifest, tuple[Tier, ...]]] = []
    for m in sorted(held, key=lambda x: (-x.step, x.job)):
        if m.origin == node or m.origin not in lost:
            continue
        e = entries.get((m.job, m.step))
        if e is None or e.manifest is None or e.manifest.encode() != m.encode():
            continue  # not (or no longer) what the catalog commits: not ours to publish
        if e.takeover is not None and e.takeover.state == DONE:
            continue
        if e.removed is not None and e.removed.of(m):
            continue  # an operator removed it (phalanx ckpt rm): never written again
        done = {c.tier for c in e.complete()}
        missing = tuple(t for t in tiers_for(m.step) if t not in done)
        if missing:
            out.append((m, missing))
    return out


async def answers(addr: str, timeout_s: float) -> bool:
    """Whether something accepts a TCP connection at ``addr`` (``host:port``) in time."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


class Takeover:
    """The keeper's heartbeat in the catalog and its takeover of lost keepers' drains."""

    def __init__(
        self,
        cfg: KeeperConfig,
        holdings: Holdings,
        drains: Drains,
        rec: Recorder,
        tasks: KeeperTasks,
        log: Any,
    ) -> None:
        if not 0 < cfg.refresh_s < cfg.lost_after_s:
            raise ValueError(
                f"lost_after_s ({cfg.lost_after_s}) must exceed refresh_s ({cfg.refresh_s}) > 0:"
                " a live keeper would look lost between two refreshes"
            )
        self.cfg, self.holdings, self.drains = cfg, holdings, drains
        self.rec, self.tasks, self.log = rec, tasks, log
        self.node = cfg.node
        self._task: asyncio.Task[None] | None = None
        self._active: set[Key] = set()  # claimed by this keeper, its drain running
        self._pending: dict[Key, tuple[Manifest, tuple[Tier, ...], int]] = {}
        """Claimed and drained, a tier not there yet (Drains retries it): m, tiers, claim revision."""
        self._settling = asyncio.Lock()
        # One tick at a time: two would both find the same orphan, and the second would
        # take this keeper's own fresh claim for a restarted keeper's and drain it again.
        self._ticking = asyncio.Lock()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="keeper-takeover")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.refresh_s)
            try:
                await self.tick()
            except Exception as exc:  # the catalog away: the next period tries again
                self.log.warning("takeover_tick_failed", error=repr(exc))

    async def tick(self) -> list[Key]:
        """One period: refresh the registration, settle finished takeovers, claim and start
        the drains to take over; returns the (job, step) whose drain it started."""
        async with self._ticking:
            return await self._tick()

    async def _tick(self) -> list[Key]:
        catalog = self.rec.catalog
        await catalog.register_keeper(self.node, self.rec.addr)
        await self._settle()
        held = [
            mem.manifest
            for mem in list(self.holdings.shm.copies.values())
            if mem.manifest.origin != self.node
            and (mem.manifest.job, mem.manifest.step) not in self._active
            and (mem.manifest.job, mem.manifest.step) not in self._pending
        ]
        if not held or not any(t in self.holdings.stores for t in TAKEOVER_TIERS):
            return []
        lost = await self.lost({m.origin for m in held})
        if not lost:
            return []
        entries: dict[Key, Entry] = {}
        for job in sorted({m.job for m in held if m.origin in lost}):
            entries.update({(job, step): e for step, e in (await catalog.entries(job)).items()})
        started: list[Key] = []
        for m, missing in orphaned(self.node, held, lost, entries, self.tiers_for):
            revision = await self._claim(m)
            if revision is None:
                continue
            key = (m.job, m.step)
            self._active.add(key)
            self.tasks.spawn(self._finish(m, missing, revision), f"keeper-takeover-{m.job}-{m.step}")
            started.append(key)
        return started

    def tiers_for(self, step: int) -> tuple[Tier, ...]:
        """The tiers of :data:`TAKEOVER_TIERS` a checkpoint of ``step`` drains to from
        this keeper (configured here, and taken by the tier policy)."""
        return tuple(t for t in self.cfg.drain_tiers(step) if t in TAKEOVER_TIERS)

    async def lost(self, nodes: Iterable[str]) -> set[str]:
        """Of ``nodes`` (this one aside), the lost keepers: registration too old, no answer."""
        asked = sorted({n for n in nodes if n != self.node})
        found = await asyncio.gather(*(self.rec.catalog.registration(n) for n in asked))
        registrations = {reg.node: reg for reg in found if reg is not None}
        suspects = stale(registrations, asked, time.time(), self.cfg.lost_after_s)
        alive = await asyncio.gather(
            *(answers(addr, self.cfg.connect_timeout_s) for addr in suspects.values())
        )
        return {node for node, up in zip(suspects, alive, strict=True) if not up}

    async def _claim(self, m: Manifest) -> int | None:
        """Claim ``m``'s drain (see the module docstring); its revision, or None: not ours."""
        catalog = self.rec.catalog
        try:
            return await catalog.claim(m.job, m.step, self.node, m.origin)
        except Conflict:
            pass
        current = await catalog.claim_of(m.job, m.step)
        if current is None or current.state == DONE:
            return None  # gone meanwhile (the next tick creates it), unreadable, or finished
        if current.node != self.node and current.node not in await self.lost([current.node]):
            return None  # a live keeper is on it
        try:
            revision = await catalog.claim(m.job, m.step, self.node, m.origin, last=current.revision)
        except Conflict:
            return None  # another keeper took it over first
        self.log.info("takeover_claim_taken", job=m.job, step=m.step, origin=m.origin, claimer=current.node)
        return revision

    async def _finish(self, m: Manifest, missing: tuple[Tier, ...], revision: int) -> None:
        key = (m.job, m.step)
        self.rec.taken_over[key] = m.origin
        self.rec.counters["taken_over"] = self.rec.counters.get("taken_over", 0) + 1
        self.log.info(
            "drain_taken_over", job=m.job, step=m.step, origin=m.origin, tiers=[t.value for t in missing]
        )
        try:
            todo: list[Tier] = []
            for tier in missing:
                if await self.holdings.holds(self.holdings.stores[tier], m):
                    # the origin wrote it and was lost before it could record it
                    found = f"found there; drain taken over from {m.origin}"
                    await self.rec.note(m, tier, COMPLETE, detail=found)
                else:
                    todo.append(tier)
            if todo:
                await self.drains.propagate_now(m, tuple(todo), replicate=False)
            self._pending[key] = (m, missing, revision)
        finally:
            self._active.discard(key)
        await self._settle(key)

    async def _settle(self, only: Key | None = None) -> None:
        """Mark ``done`` the claims whose drain is finished (every missing tier holds the
        copy). One whose tier failed stays pending while :class:`Drains` retries it; one
        whose memory copy is gone meanwhile is released (the claim deleted) for another
        keeper holding a replica."""
        async with self._settling:
            for key, (m, tiers, revision) in list(self._pending.items()):
                if only is not None and key != only:
                    continue
                if all([await self.holdings.holds(self.holdings.stores[t], m) for t in tiers]):
                    outcome = await self._end_claim(m, revision, done=True)
                elif key not in self.holdings.shm.copies:
                    outcome = await self._end_claim(m, revision, done=False)
                else:
                    continue
                del self._pending[key]
                self.rec.taken_over.pop(key, None)
                self.log.info(outcome, job=m.job, step=m.step, origin=m.origin)

    async def _end_claim(self, m: Manifest, revision: int, *, done: bool) -> str:
        catalog = self.rec.catalog
        try:
            if done:
                await catalog.claim_done(m.job, m.step, self.node, m.origin, last=revision)
            else:
                await catalog.unclaim(m.job, m.step, last=revision)
        except Conflict:  # judged lost meanwhile, and taken over: the other keeper has it
            return "takeover_claim_moved"
        return "drain_takeover_done" if done else "takeover_released"
