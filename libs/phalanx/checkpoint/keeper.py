"""The keeper: one per node (the state-replication service), owner of the node's checkpoints.

What it does with a snapshot a rank left in a shared-memory slot
(:mod:`phalanx.checkpoint.slots`), in this order and off the training thread:

1. **take** it: checksum it into a :class:`Manifest`, mark the slot HELD; the
   checkpoint is now complete in ``memory`` on this node;
2. **replicate** it to ``replicas`` keepers on other nodes over TCP (their
   addresses are in the catalog), each of which verifies the checksums and keeps
   it in its own shared memory: losing this node loses no checkpoint (a replica that
   could not be made is reported and retried until it exists);
3. **drain** it to the durable tiers its step goes to (``PHALANX_CKPT_TIERS``), in
   lanes side by side -- by default the object store, streamed from the memory copy,
   beside the disk and then the shared path (:mod:`~phalanx.checkpoint.drainplan`) --
   committing each copy's manifest last;
4. apply each tier's :class:`RetentionPolicy`; a memory copy is released (its
   slot freed for the rank) only once a durable copy exists;
5. refresh its registration in the catalog, and finish the shared and object drains
   of a lost keeper's checkpoints it holds a replica of (:mod:`~phalanx.checkpoint.takeover`).

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

The parts, each in its module: :mod:`~phalanx.checkpoint.intake` (slots, DCP
directories, re-adoption), :mod:`~phalanx.checkpoint.drains` (replicate and drain,
retries), :mod:`~phalanx.checkpoint.replicas` (replicas retried until they exist),
:mod:`~phalanx.checkpoint.replication` and
:mod:`~phalanx.checkpoint.peerserver` (the peer protocol, both ends),
:mod:`~phalanx.checkpoint.restore` (``load``), :mod:`~phalanx.checkpoint.ranksocket`
(the ranks' socket), :mod:`~phalanx.checkpoint.holdings` (tiers and retention),
:mod:`~phalanx.checkpoint.memcopy` (copies in shared memory) and
:mod:`~phalanx.checkpoint.record` (catalog, events, counters). :class:`Keeper` wires
them and owns their life.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import phalanx.checkpoint.peerauth as peerauth
from phalanx.bus import Bus
from phalanx.checkpoint.drains import Drains
from phalanx.checkpoint.holdings import Holdings
from phalanx.checkpoint.intake import Intake
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.keepertasks import KeeperTasks
from phalanx.checkpoint.manifest import Kind, Manifest
from phalanx.checkpoint.memcopy import MemCopy, SharedMemory
from phalanx.checkpoint.peerserver import PeerServer
from phalanx.checkpoint.ranksocket import RankSocket
from phalanx.checkpoint.record import Recorder
from phalanx.checkpoint.removal import Removal
from phalanx.checkpoint.replicas import Replicas
from phalanx.checkpoint.replication import Replicator
from phalanx.checkpoint.restore import Restorer
from phalanx.checkpoint.takeover import Takeover
from phalanx.checkpoint.tiers import Store, Tier
from phalanx.telemetry import get_logger

__all__ = ["Keeper"]


class Keeper:
    """One node's keeper: its parts wired together, started and stopped in order."""

    def __init__(self, bus: Bus, config: KeeperConfig) -> None:
        self.bus, self.cfg = bus, config
        self.node = config.node
        self.log = log = get_logger(component="keeper", node=self.node)
        self.tasks = KeeperTasks(log, self.node)
        self.rec = Recorder(bus, self.node, config.retry, self.tasks, log)
        self.shm = SharedMemory(config, log)
        self.holdings = Holdings(config, self.shm, self.rec, log)
        peerauth.check_key(config.key, "the keeper key (KeeperConfig.key, PHALANX_KEEPER_KEY)")
        self.replicator = Replicator(config, self.holdings, self.rec, log)
        self.replicas = Replicas(config, self.holdings, self.replicator, self.rec, self.tasks, log)
        self.drains = Drains(config, self.holdings, self.replicas, self.rec, self.tasks, log)
        self.restorer = Restorer(self.holdings, self.replicator, self.drains, self.rec, log)
        self.intake = Intake(config, self.holdings, self.drains, self.rec, log)
        self.peers = PeerServer(config, self.holdings, self.rec, self.tasks, log)
        self.ranks = RankSocket(config, self.intake, self.restorer, self.rec, log)
        self.takeover = Takeover(config, self.holdings, self.drains, self.rec, self.tasks, log)
        self.removal = Removal(config, self.holdings, self.rec, log)  # phalanx ckpt rm
        self._scanner: asyncio.Task[None] | None = None

    # -- what the service, the metrics and the tests read ----------------------------------
    @property
    def addr(self) -> str:
        """Where peers reach this keeper (``host:port``), once started."""
        return self.rec.addr

    @property
    def memory(self) -> dict[tuple[str, int], MemCopy]:
        return self.shm.copies

    @property
    def stores(self) -> dict[Tier, Store]:
        return self.holdings.stores

    @property
    def counters(self) -> dict[str, int]:
        return self.rec.counters

    @property
    def on_copy(self) -> Any:
        """Called with (job, tier, state, step, bytes) for every copy that changes state (metrics)."""
        return self.rec.on_copy

    @on_copy.setter
    def on_copy(self, callback: Any) -> None:
        self.rec.on_copy = callback

    @property
    def on_replicas(self) -> Any:
        """Called with (job, checkpoint, missing) when a checkpoint's missing replicas change (metrics)."""
        return self.rec.on_replicas

    @on_replicas.setter
    def on_replicas(self, callback: Any) -> None:
        self.rec.on_replicas = callback

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        catalog = await self.rec.open()
        await asyncio.to_thread(self.intake.prepare_node_dir)
        await self.removal.start()  # before adopt: nothing of a removed checkpoint is taken again
        self.rec.addr = await self.peers.start()
        await catalog.register_keeper(self.node, self.addr)
        await self.intake.adopt()
        await self.scan_once()  # the slots adopted: taken again before any rank may ask
        # The ranks' socket last: a rank that finds it gets a keeper whose catalog is true.
        await self.ranks.start()
        self._scanner = asyncio.create_task(self.intake.scan_loop(), name="keeper-scan")
        self.takeover.start()
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
        self.takeover.stop()
        await self.removal.stop()
        self.peers.close()
        self.ranks.close()
        await self.tasks.cancel()
        self.drains.close()
        self.ranks.unlink()

    async def idle(self, timeout_s: float = 120.0) -> None:
        """Wait until no take, replication or drain is in flight (tests, benchmarks)."""
        await self.tasks.idle(timeout_s)

    def health(self) -> dict[str, str | int | float | bool]:
        return {"addr": self.addr, "memory_copies": len(self.memory), **self.counters}

    # -- what a rank asks (through the socket, or in-process) ------------------------------
    async def scan_once(self) -> None:
        """Take every READY slot (returns once what this scan found is taken)."""
        await self.intake.scan_once()

    async def register_directory(self, job: str, step: int, directory: Path, kind: Kind = "dcp") -> Manifest:
        """Adopt a DCP checkpoint a job wrote in ``directory`` (:meth:`Intake.register_directory`)."""
        return await self.intake.register_directory(job, step, directory, kind)

    async def checkpoints(self, job: str) -> list[dict[str, Any]]:
        """Every checkpoint of ``job`` with a complete copy somewhere, newest first."""
        return await self.restorer.checkpoints(job)

    async def load(self, job: str, step: int | None) -> dict[str, Any]:
        """A verified copy of ``job@step`` (None: the newest) in this node's memory (:meth:`Restorer.load`)."""
        return await self.restorer.load(job, step)

    async def skipped(self, job: str, step: int, why: str) -> None:
        """A rank skipped a save: an event and a metric (:meth:`Recorder.skipped`)."""
        await self.rec.skipped(job, step, why)
