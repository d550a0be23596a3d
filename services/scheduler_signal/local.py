"""The local cluster as a source: a watch of the ``phalanx_cluster`` KV bucket.

``phalanx cluster offer`` / ``reclaim`` (:mod:`phalanx.cluster`) keep one JSON
record per cluster there. Each revision of a record becomes, through the
:class:`~phalanx.services.scheduler_signal.sources.Ledger` (so once, restarts
included):

- a ``CapacityChanged`` when the slots changed: ``available_slots`` their sum over
  ready nodes, ``offered`` the slots per node, ``source="local"``;
- a ``PreemptionNotice`` per preemption not announced yet, with its ``nodes``,
  ``reason`` and, as ``deadline_s``, what is left of its grace (from its ``at``).

The watch replays the latest revision of every record when it starts; it is
started again after an error (the bus down: what was not published is published
then) and after a reconnect. A missing bucket or an empty one is not an error;
a record that does not parse is logged and skipped. A deleted record is a
cluster offering nothing.

>>> src = KvClusterSource(bus, Ledger(StreamHistory(bus), "local"))
>>> await src.run(service.emit)         # until cancelled
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.js.errors import NotFoundError
from phalanx.services.scheduler_signal.sources import Emit, Ledger, state_signals

from phalanx.bus import Bus, KvEntry
from phalanx.bus.keywatch import WatchLost
from phalanx.cluster import check_name, parse_record
from phalanx.contract.cluster import ClusterState
from phalanx.contract.streams import CLUSTER_BUCKET
from phalanx.telemetry import get_logger


class KvClusterSource:
    """Watches every record of the ``phalanx_cluster`` bucket and emits what changed."""

    name = "local"

    def __init__(self, bus: Bus, ledger: Ledger, *, retry_s: float = 1.0, check_s: float = 1.0) -> None:
        self.bus = bus
        self.ledger = ledger
        self.retry_s = retry_s  # wait before watching again after an error
        self.check_s = check_s  # how often a quiet watch looks for a reconnect
        self.log = get_logger(component="scheduler-signal", source="local", bucket=CLUSTER_BUCKET)
        self.revisions = 0  # record revisions handled
        self.watches = 0  # watches started
        self.synced = False  # the current watch delivered every record's latest revision
        self.last_error = ""
        self._missing_logged = False

    def details(self) -> dict[str, str | int | float | bool]:
        return {
            "local.bucket": CLUSTER_BUCKET,
            "local.revisions": self.revisions,
            "local.watches": self.watches,
            "local.synced": self.synced,
            "local.last_error": self.last_error,
        }

    async def run(self, emit: Emit) -> None:
        while True:
            try:
                await self._watch(emit)
            except asyncio.CancelledError:
                raise
            except NotFoundError:  # no bucket yet (a bus connected without ensure)
                if not self._missing_logged:
                    self.log.info("cluster_bucket_missing")
                    self._missing_logged = True
            except Exception as exc:  # NATS away, a publish refused: watch again, the ledger dedups
                self.last_error = repr(exc)
                self.log.warning("cluster_watch_failed", error=repr(exc), retry_s=self.retry_s)
            self.synced = False
            await asyncio.sleep(self.retry_s)

    async def _watch(self, emit: Emit) -> None:
        kv = await self.bus.kv.bucket(CLUSTER_BUCKET)
        self._missing_logged = False
        reconnects = self.bus.reconnects
        # Not cancelled half-way: a watch whose subscription exists but was never
        # returned could not be stopped, and would hold up the connection's drain.
        starting = asyncio.ensure_future(kv.watch_all())
        try:
            watcher = await asyncio.shield(starting)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await (await starting).stop()
            raise
        self.watches += 1
        try:
            while True:
                try:
                    entry = await watcher.next(self.check_s)
                except TimeoutError:
                    if self.bus.reconnects != reconnects:
                        return  # the ordered consumer may be gone with the old connection
                    continue
                except WatchLost:  # the watcher was stopped
                    return
                if entry is None:  # every record's latest revision was delivered
                    self.synced = True
                    continue
                await self.handle(entry, emit)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(watcher.stop())

    async def handle(self, entry: KvEntry, emit: Emit) -> None:
        """Emit what one revision of a record changed."""
        try:
            cluster = check_name("cluster", entry.key)
            if entry.operation is None:
                state = parse_record(cluster, entry.value)
            else:  # deleted or purged: the cluster offers nothing
                state = ClusterState(cluster=cluster)
        except ValueError as exc:
            self.last_error = str(exc)
            self.log.error("cluster_record_invalid", key=entry.key, revision=entry.revision, error=str(exc))
            return
        for sig in await state_signals(self.ledger, state, f"kv{entry.revision}"):
            await emit(sig)
            self.ledger.published(sig)
        self.revisions += 1
        self.last_error = ""
        self.log.info(
            "cluster_record_read",
            cluster=cluster,
            revision=entry.revision,
            available=state.available_slots,
            offered=state.offered,
        )
