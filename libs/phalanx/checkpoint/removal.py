"""Removing a checkpoint everywhere, when an operator asks (``phalanx ckpt rm JOB STEP``).

The command writes the checkpoint's tombstone, ``<job>.<step:012d>.removed`` in the
catalog (its job, step and manifest's ``created``, when and by whom), then deletes its
manifest: from that moment nothing lists or loads it. Every keeper watches the
tombstones (a KV watch of ``*.*.removed``) and removes what it holds of that
checkpoint -- its memory copy (released as retention releases one: the slot freed for
the rank, a replica's directory removed), its disk copy, and the shared and object
copies (one for every node: any keeper that has those tiers deletes them, which is
idempotent) -- each with a ``deleted`` record (the catalog key forgotten) and event.
A catalog key of this keeper's left with nothing behind it is forgotten too.

Only the checkpoint removed: a copy is removed when its manifest's ``created`` is the
tombstone's, so a later save of the same step (a job that ran that step again) is left
alone.

Races, and a keeper that was away:

- a drain, a replica or a drain taken over may record a copy of the checkpoint just
  after the sweep: for :data:`SETTLE_S` after a new tombstone each keeper also watches
  the step's keys and sweeps again on any new record (and deletes the manifest again
  should a keeper's delayed catalog write bring it back);
- a keeper that was down when the command ran reads the tombstones when it starts,
  *before* it re-adopts what outlived it (:meth:`Removal.start`, called first): held
  and ready slots of a removed checkpoint are freed, its replicas and restored copies
  removed, its disk copy deleted -- nothing of it is taken, listed or drained again.
  Shared and object copies are then removed only where the catalog still lists one.

Tombstones stay in the catalog (a few dozen bytes each): they are what a keeper that
comes back reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import phalanx.checkpoint.paths as paths
from phalanx.bus.keywatch import WatchLost
from phalanx.checkpoint.catalog import REMOVED, Entry, Removed
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.slots import SlotError, SlotState, scan
from phalanx.checkpoint.tiers import Tier, step_key

SETTLE_S = 60.0
"""How long after a new tombstone a keeper keeps watching the step's keys."""
DETAIL = "removed by an operator (phalanx ckpt rm)"


class Removal:
    """This keeper's part of ``phalanx ckpt rm``: :meth:`start` before the keeper re-adopts
    anything, :meth:`stop` with it."""

    def __init__(self, cfg: KeeperConfig, holdings: Holdings, rec: Recorder, log: Any) -> None:
        self.cfg, self.holdings, self.rec, self.log = cfg, holdings, rec, log
        self.shm = holdings.shm
        self.node = cfg.node
        self.settle_s = SETTLE_S
        self.known: dict[tuple[str, int], Removed] = {}  # every tombstone seen
        self.removed = 0  # copies removed (a counter for tests and health)
        self._tasks: set[asyncio.Task[None]] = set()
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}

    async def start(self) -> None:
        """Carry out the tombstones already in the catalog -- what is left here of removed
        checkpoints goes before :meth:`Intake.adopt` would take it again -- then follow
        new ones. A catalog that cannot be read is logged: the watch finds them later."""
        try:
            found = await self.rec.catalog.removals()
        except Exception as exc:
            self.log.warning("removals_unread", error=repr(exc))
            found = {}
        self.known = dict(found)
        if found:
            await asyncio.to_thread(self._leftovers, found)
            entries: dict[str, dict[int, Entry]] = {}
            for t in found.values():
                try:
                    if t.job not in entries:
                        entries[t.job] = await self.rec.catalog.entries(t.job)
                    await self.sweep(t, entries[t.job].get(t.step), live=False)
                except Exception as exc:  # one checkpoint's trouble does not keep the keeper from starting
                    self.log.warning("removal_failed", job=t.job, step=t.step, error=repr(exc))
        self._spawn(self._follow(), "keeper-removal")

    async def stop(self) -> None:
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _spawn(self, coro: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- following the tombstones ----------------------------------------------------------
    async def _follow(self) -> None:
        """Each new tombstone, carried out as it comes (the watch replays those known)."""
        while True:
            watch = None
            try:
                watch = await self.rec.catalog.watch(f"*.*.{REMOVED}")
                async for entry in watch:
                    if entry.operation is not None or not entry.value:
                        continue  # a tombstone deleted (by hand): nothing to do
                    t = Removed.parse(entry.value)
                    if t is None or self.known.get((t.job, t.step)) == t:
                        continue
                    self.known[(t.job, t.step)] = t
                    self.log.info("checkpoint_removal", job=t.job, step=t.step, by=t.by)
                    self._spawn(self._carry_out(t), f"keeper-removal-{t.job}-{t.step}")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # WatchLost, the bus away: a new watch replays what is known
                self.log.info("removal_watch_lost", error=repr(exc))
                await asyncio.sleep(1.0)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await watch.stop()

    async def _carry_out(self, t: Removed) -> None:
        """Sweep now, then again on every change to the step's keys for ``settle_s``."""
        try:
            await self._sweep_now(t)
        except Exception as exc:
            self.log.warning("removal_failed", job=t.job, step=t.step, error=repr(exc))
        try:
            await asyncio.wait_for(self._settle(t), self.settle_s)
        except TimeoutError:
            pass  # settled
        except Exception as exc:  # the watch could not be made: the sweep above stands
            self.log.warning("removal_settle_failed", job=t.job, step=t.step, error=repr(exc))

    async def _settle(self, t: Removed) -> None:
        changed = asyncio.Event()

        async def sweeper() -> None:
            while True:
                await changed.wait()
                await asyncio.sleep(0.05)  # several records at once: one sweep
                changed.clear()
                try:
                    await self._sweep_now(t)
                except Exception as exc:
                    self.log.warning("removal_failed", job=t.job, step=t.step, error=repr(exc))

        task = asyncio.create_task(sweeper())
        watch = await self.rec.catalog.watch(f"{t.job}.{step_key(t.step)}.>")
        try:
            async for entry in watch:
                if entry.operation is not None or not entry.value:
                    continue  # a key forgotten: what removal does
                if _manifest_of(entry.value, t) and await self.rec.catalog.remove_manifest(
                    t.job, t.step, t.created
                ):
                    self.log.warning("removed_manifest_back", job=t.job, step=t.step)
                changed.set()
        except WatchLost as exc:
            self.log.info("removal_watch_lost", job=t.job, step=t.step, error=str(exc))
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            with contextlib.suppress(Exception):
                await watch.stop()

    async def _sweep_now(self, t: Removed) -> None:
        async with self._locks.setdefault((t.job, t.step), asyncio.Lock()):
            entry = (await self.rec.catalog.entries(t.job)).get(t.step)
            await self.sweep(t, entry, live=True)

    # -- what this keeper holds of a removed checkpoint ------------------------------------
    async def sweep(self, t: Removed, entry: Entry | None, *, live: bool) -> None:
        """Remove this keeper's copies of ``t``'s checkpoint and forget the catalog keys
        it answers for that have nothing behind them. ``entry``: the catalog's record of
        the step. Not ``live`` (at a start): shared and object copies only where the
        catalog still lists one (every keeper start would list every tombstone's otherwise)."""
        gone: list[tuple[Manifest, Tier]] = []
        mem = self.shm.copies.get((t.job, t.step))
        if mem is not None and t.of(mem.manifest):
            del self.shm.copies[(t.job, t.step)]
            self.shm.release(mem)
            gone.append((mem.manifest, Tier.MEMORY))
        listed_tiers = {c.tier for c in entry.copies} if entry is not None else set()
        for tier, store in self.holdings.stores.items():
            if not live and tier is not Tier.DISK and tier not in listed_tiers:
                continue
            for m in await self.holdings.listed(store, t.job) or []:
                if not t.of(m):
                    continue
                try:
                    await asyncio.to_thread(store.delete, t.job, t.step)
                except FileNotFoundError:
                    continue  # another keeper removed this shared copy first
                except Exception as exc:  # an object store's own error types
                    self.log.warning(
                        "removal_failed", job=t.job, step=t.step, tier=tier.value, error=repr(exc)
                    )
                    continue
                gone.append((m, tier))
        for m, tier in gone:
            self.removed += 1
            await self.rec.note(m, tier, "deleted", detail=DETAIL)
        if entry is not None:
            noted = {tier for _, tier in gone}
            for c in entry.copies:
                if (
                    c.tier not in noted
                    and self._answers_for(c.tier, c.node)
                    and not await self._holds(t, c.tier)
                ):
                    await self.rec.catalog.forget(t.job, t.step, c.tier, c.node)
                    self.log.info("copy_forgotten", job=t.job, step=t.step, tier=c.tier.value, node=c.node)

    def _answers_for(self, tier: Tier, node: str) -> bool:
        if tier in (Tier.MEMORY, Tier.DISK):
            return node == self.node
        return tier in self.holdings.stores

    async def _holds(self, t: Removed, tier: Tier) -> bool:
        """Whether this keeper holds a copy of ``t``'s step in ``tier`` (any save of it: a
        later one's record is its own)."""
        if tier is Tier.MEMORY:
            return (t.job, t.step) in self.shm.copies
        store = self.holdings.stores.get(tier)
        listed = await self.holdings.listed(store, t.job) if store is not None else []
        return listed is None or any(m.step == t.step for m in listed)  # unlistable: kept

    def _leftovers(self, found: dict[tuple[str, int], Removed]) -> None:
        """What outlived the previous keeper of this node of removed checkpoints, in its
        shared memory: held and ready slots are freed (the scan would take them again and
        commit their manifest anew), replicas and restored copies removed. Blocking."""
        result = scan(self.cfg.shm_root, self.node, self.cfg.job_uid)
        for job, f in result.slots:
            try:
                h = f.header()
                t = found.get((job, h.step))
                if (
                    t is not None
                    and h.state in (SlotState.HELD, SlotState.READY)
                    and h.written_at == t.created
                ):
                    f.set_state(SlotState.FREE)
                    self.log.info("slot_freed", job=job, step=h.step, detail=DETAIL)
            except SlotError:
                pass  # the intake reports it
            finally:
                f.close()
        for t in found.values():
            for kind in ("replicas", "restored"):
                name = step_key(t.step)
                try:
                    with paths.dir_at(self.cfg.node_dir, kind, t.job, name) as fd:
                        with open(paths.open_file(fd, MANIFEST_NAME, os.O_RDONLY), "rb") as mf:
                            m = Manifest.parse(mf.read(MAX_MANIFEST_BYTES + 1), f"{kind}/{t.job}/{name}")
                    if t.of(m):
                        paths.rmtree_at(self.cfg.node_dir, kind, t.job, name)
                        self.log.info("shm_copy_removed", job=t.job, step=t.step, kind=kind, detail=DETAIL)
                except (OSError, ManifestError):
                    continue  # not there (or not ours to read: the intake reports it)


def _manifest_of(raw: bytes, t: Removed) -> bool:
    """Whether ``raw`` is the removed checkpoint's manifest (put again after its removal)."""
    if not raw.startswith(b"{"):
        return False  # a copy record (msgpack)
    try:
        return t.of(Manifest.parse(raw))
    except ManifestError:
        return False
