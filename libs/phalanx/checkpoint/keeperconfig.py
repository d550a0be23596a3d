"""What a node's keeper (:mod:`phalanx.checkpoint.keeper`) is configured with."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.checkpoint.drainplan import DrainPlan
from phalanx.checkpoint.manifest import job_of
from phalanx.checkpoint.tiers import DRAIN_ORDER, RetryPolicy, Tier
from phalanx.settings import RetentionPolicy, TierPolicy


@dataclass
class KeeperConfig:
    node: str
    shm_root: Path = Path("/dev/shm/phalanx")
    disk_root: Path | None = None
    shared_root: Path | None = None
    object_url: str | None = None
    host: str = "127.0.0.1"  # where peers reach this keeper (TCP)
    port: int = 0
    replicas: int = 1
    tier_policy: TierPolicy = field(default_factory=TierPolicy)
    """Which checkpoints go to which tier and what each keeps (``PHALANX_CKPT_TIERS``);
    it may name only tiers configured here. Default: every checkpoint to every tier."""
    retention: dict[Tier, RetentionPolicy] = field(default_factory=dict)
    """What each tier keeps: left empty, :attr:`tier_policy`'s (memory 2, disk 5, shared
    5, object 3 by default); a tier missing from a dict given keeps everything."""
    scan_s: float = 0.05
    fsync: bool = True
    connect_timeout_s: float = 2.0
    key: bytes = b""
    """The cluster's keeper key (:mod:`phalanx.checkpoint.peerauth`): required, >= 32 bytes."""
    auth_timeout_s: float = 5.0  # a peer that has not proved the key by then is dropped
    io_timeout_s: float = 30.0  # the longest wait for any read or write with a peer
    min_rate: float = float(8 << 20)  # bytes/s: a slower transfer, on the whole, is dropped
    max_bytes: int = 64 << 30  # the largest checkpoint received or restored
    shm_reserve_bytes: int = 256 << 20  # shared memory a receive or restore leaves free
    max_connections: int = 64  # authenticated peer connections served at once
    max_connections_per_peer: int = 8  # of those, from one address
    max_handshakes: int = 64  # peer connections not yet authenticated, at once
    max_handshakes_per_peer: int = 4  # of those, from one address
    auth_failure_burst: int = 8
    """Failed handshakes (a wrong key, a timeout) an address may make in a row; then it
    is refused at once, given one more try every :attr:`auth_failure_refill_s`."""
    auth_failure_refill_s: float = 10.0
    rank_max_connections: int = 64  # connections to the ranks' socket at once
    rank_max_connections_per_uid: int = 32  # of those, from one uid
    max_request_bytes: int = 1 << 20
    """The largest request a rank may send over the ranks' socket: a ``register`` of a
    DCP set names every part and file (~350 KiB for 4096 ranks of a 64-character job)."""
    max_fills: int = 2  # copies received or restored into shared memory at once
    job_uids: dict[str, int] = field(default_factory=dict)
    """The uid each job's ranks run as (its group: the same number); a job not listed
    runs as the keeper's own uid (one uid for everything)."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """Failed tier writes and catalog writes are retried with this backoff."""
    drain: DrainPlan = field(default_factory=DrainPlan)
    """Lanes, rates and priority of the drains (:mod:`phalanx.checkpoint.drainplan`)."""
    refresh_s: float = 5.0
    """How often the keeper refreshes its ``=keeper`` registration and looks for drains
    to take over (:mod:`phalanx.checkpoint.takeover`)."""
    lost_after_s: float = 30.0
    """A keeper whose registration is older than this (and that does not answer a TCP
    connect) is lost: its unfinished drains are taken over. Several ``refresh_s``."""

    def __post_init__(self) -> None:
        self.tier_policy.check(self.durable_tiers)
        if not self.retention:
            self.retention = {Tier(t): r for t, r in self.tier_policy.retention().items()}

    @property
    def durable_tiers(self) -> tuple[Tier, ...]:
        """The durable tiers configured here, in drain order."""
        roots = {Tier.DISK: self.disk_root, Tier.SHARED: self.shared_root, Tier.OBJECT: self.object_url}
        return tuple(t for t in DRAIN_ORDER if roots[t])

    def drain_tiers(self, step: int) -> tuple[Tier, ...]:
        """The configured durable tiers a checkpoint of ``step`` drains to, in drain order
        (:meth:`TierPolicy.tiers_for`); empty: it stays in memory only, released by memory's
        retention alone (:meth:`Holdings.retain`)."""
        return tuple(Tier(t) for t in self.tier_policy.tiers_for(step, self.durable_tiers))

    @property
    def node_dir(self) -> Path:
        return self.shm_root / self.node

    @property
    def socket_path(self) -> Path:
        return self.node_dir / "keeper.sock"

    def job_uid(self, job: str) -> int:
        """The uid the ranks of ``job`` run as (:attr:`job_uids`); a part of a DCP
        checkpoint (``<job>=r<rank>``) is its job's."""
        return self.job_uids.get(job_of(job), os.geteuid())

    @property
    def rank_uids(self) -> frozenset[int]:
        """The uids that may use the ranks' socket: root, the keeper's own (a job not in
        :attr:`job_uids` runs as it) and each job's; any other could ask for nothing."""
        return frozenset({0, os.geteuid(), *self.job_uids.values()})

    def job_group(self, job: str) -> int | None:
        """The group that may read ``job``'s copies in shared memory: its uid's (a part's:
        its job's), None for a job not listed in :attr:`job_uids`."""
        return self.job_uids.get(job_of(job))
