"""The state-replication service: one keeper per node, following plans and recoveries.

Inputs, through durable JetStream consumers named after the node (so each keeper
sees every message, and a restarted keeper resumes where it stopped):

- ``Plan`` on ``phalanx.cmd.*.plan`` (stream ``PHALANX_CMD``): a new generation's
  membership, which says who holds what state and who must receive it;
- ``RecoveryDone`` on ``phalanx.evt.*.recovered`` (stream ``PHALANX_EVT``): a rank
  finished its first step in a generation, so transfers for it are over.

Each message is handled in the consumer span of its trace (so it joins the
incident's trace) and recorded in :class:`JobView`.

It runs the node's checkpoint keeper (:mod:`phalanx.checkpoint.keeper`): it takes
the snapshots ranks leave in shared memory, replicates them to peer keepers,
drains them through the tiers and serves restores. Environment (a bad value is
refused at start):

- ``PHALANX_NODE`` (default: the host name) names the node;
- ``PHALANX_SHM_ROOT`` (``/dev/shm/phalanx``): the shared memory ranks and keeper share;
- ``PHALANX_KEEPER_HOST`` (``127.0.0.1``) and ``PHALANX_KEEPER_PORT`` (0: any): where
  peers reach this keeper (use the node's address on a multi-node job);
- ``PHALANX_CKPT_REPLICAS`` (1): peer keepers that get each snapshot;
- ``PHALANX_CKPT_DISK``, ``PHALANX_CKPT_SHARED``: the local-disk and shared file
  system tiers (a directory each; unset: no such tier), ``PHALANX_CKPT_OBJECT``:
  ``s3://bucket[/prefix]`` (with the usual ``AWS_*`` variables);
- ``PHALANX_CKPT_TIERS``: which checkpoints each tier takes and what it keeps, one
  entry per tier, e.g. ``memory:every=50,last=2; disk:every=200,last=5;
  object:every=1000,last=3,pin=10000`` (:class:`~phalanx.settings.TierPolicy`; unset:
  every checkpoint to every configured tier, keeping memory 2, disk 5, shared 5,
  object 3). A policy naming a tier this keeper lacks, a durable ``every`` that is not
  a multiple of memory's, or any malformed entry is refused at start;
- ``PHALANX_CKPT_FSYNC`` (1): fsync each file written to disk and shared tiers;
- ``PHALANX_KEEPER_KEY`` or ``PHALANX_KEEPER_KEY_FILE`` (required, >= 32 bytes, the
  same on every node): the key keepers prove to each other before any replicate or
  fetch (:mod:`phalanx.checkpoint.peerauth`);
- bounds on what a peer may hold: ``PHALANX_KEEPER_TIMEOUT_S`` (30, each read or
  write), ``PHALANX_KEEPER_AUTH_TIMEOUT_S`` (5), ``PHALANX_KEEPER_MIN_RATE`` (8 MiB/s
  on the whole transfer), ``PHALANX_KEEPER_MAX_CONNECTIONS`` (64 authenticated) and
  ``_PER_PEER`` (8), ``PHALANX_KEEPER_MAX_HANDSHAKES`` (64 not yet authenticated) and
  ``_PER_PEER`` (4), ``PHALANX_KEEPER_AUTH_FAILURE_BURST`` (8 failed handshakes in a
  row from one address, then it is refused at once) and ``_REFILL_S`` (10: one more
  try each), ``PHALANX_KEEPER_MAX_FILLS`` (2 copies received or restored at
  once), ``PHALANX_CKPT_MAX_BYTES`` (64 GiB) and ``PHALANX_KEEPER_SHM_RESERVE_BYTES``
  (256 MiB of shared memory a receive leaves free);
- bounds on what a local process may hold on the ranks' socket (checked, with its uid,
  before a byte is read): ``PHALANX_KEEPER_RANK_MAX_CONNECTIONS`` (64) and ``_PER_UID``
  (32), ``PHALANX_KEEPER_MAX_REQUEST_BYTES`` (1 MiB: a register of a DCP set of 4096
  ranks is ~350 KiB); only root, the keeper's uid and the uids of
  ``PHALANX_CKPT_JOB_UIDS`` may connect;
- ``PHALANX_CKPT_JOB_UIDS`` (unset): ``job=uid,...``, the uid each job's ranks run as
  on this node (a job not listed: the keeper's own uid). The keeper takes a job's
  slots only from a directory and files that uid owns, accepts ``register`` only from
  a process of that uid (``SO_PEERCRED``), and gives the copies it writes for the job
  that group (the keeper is a member of each job's group, or root);
- ``PHALANX_CKPT_RETRY_MAX_S`` (300): the longest wait between retries of a failed
  tier write or catalog write (they start at 1 s and double);
- ``PHALANX_KEEPER_REFRESH_S`` (5) and ``PHALANX_KEEPER_LOST_AFTER_S`` (30): how often
  the keeper refreshes its registration in the catalog, and how old another's may get
  (with nothing answering on its port) before its drains are taken over
  (:mod:`phalanx.checkpoint.takeover`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nats.aio.msg import Msg
from opentelemetry import trace

from phalanx.bus import Bus
from phalanx.checkpoint.drainplan import DrainPlan
from phalanx.checkpoint.keeper import Keeper
from phalanx.checkpoint.keeperconfig import KeeperConfig
from phalanx.checkpoint.peerauth import load_key
from phalanx.checkpoint.slots import node_name, shm_root
from phalanx.checkpoint.tiers import RetryPolicy
from phalanx.contract import Message, Plan, RecoveryDone
from phalanx.contract.streams import COMMANDS, EVENTS
from phalanx.contract.subjects import PLAN, RECOVERED
from phalanx.metrics import ReplicationMetrics
from phalanx.service import Service
from phalanx.settings import KeeperSettings, load


def keeper_config(node: str) -> KeeperConfig:
    """The keeper's configuration from the settings (``PHALANX_CKPT_*``, ``PHALANX_KEEPER_*``);
    :class:`~phalanx.settings.SettingsError` without a keeper key."""
    settings = load(KeeperSettings)
    return KeeperConfig(
        node=node,
        shm_root=shm_root(),
        disk_root=settings.ckpt_disk,
        shared_root=settings.ckpt_shared,
        object_url=settings.ckpt_object,
        host=settings.keeper_host,
        port=settings.keeper_port,
        replicas=settings.ckpt_replicas,
        fsync=settings.ckpt_fsync,
        key=load_key(settings),
        auth_timeout_s=settings.keeper_auth_timeout_s,
        io_timeout_s=settings.keeper_timeout_s,
        min_rate=settings.keeper_min_rate_bytes_per_s,
        max_bytes=settings.ckpt_max_bytes,
        shm_reserve_bytes=settings.keeper_shm_reserve_bytes,
        max_connections=settings.keeper_max_connections,
        max_connections_per_peer=settings.keeper_max_connections_per_peer,
        max_handshakes=settings.keeper_max_handshakes,
        max_handshakes_per_peer=settings.keeper_max_handshakes_per_peer,
        auth_failure_burst=settings.keeper_auth_failure_burst,
        auth_failure_refill_s=settings.keeper_auth_failure_refill_s,
        rank_max_connections=settings.keeper_rank_max_connections,
        rank_max_connections_per_uid=settings.keeper_rank_max_connections_per_uid,
        max_request_bytes=settings.keeper_max_request_bytes,
        max_fills=settings.keeper_max_fills,
        job_uids=settings.ckpt_job_uids,
        retry=RetryPolicy(max_s=settings.ckpt_retry_max_s),
        refresh_s=settings.keeper_refresh_s,
        lost_after_s=settings.keeper_lost_after_s,
        tier_policy=settings.tier_policy,  # retention: the policy's (KeeperConfig.__post_init__)
        drain=DrainPlan.parse(
            settings.ckpt_drain,
            settings.ckpt_rate,
            nice=settings.keeper_drain_nice,
            idle_io=settings.keeper_drain_idle_io,
            object_part_bytes=settings.ckpt_object_part_bytes,
            object_concurrency=settings.ckpt_object_concurrency,
        ),
    )


@dataclass
class JobView:
    """What this keeper knows of one job."""

    plan: Plan | None = None  # the newest (Plan.supersedes)
    members: dict[str, int] = field(default_factory=dict)  # worker -> rank
    recovered: set[str] = field(default_factory=set)  # workers done in ``generation``

    @property
    def generation(self) -> int:
        return self.plan.generation if self.plan is not None else 0


class StateReplication(Service):
    name = "state-replication"
    metrics_type = ReplicationMetrics
    settings_type = KeeperSettings
    metrics: ReplicationMetrics

    def __init__(self, bus: Bus, node: str | None = None, keeper: KeeperConfig | None = None) -> None:
        super().__init__(bus)
        self.node = node or node_name()
        self.keeper = Keeper(bus, keeper or keeper_config(self.node))
        self.keeper.on_copy = self.metrics.copy_changed
        self.keeper.on_replicas = self.metrics.replicas_changed
        self.jobs: dict[str, JobView] = {}
        self.plans = 0
        self.recoveries = 0
        self.stale = 0
        self.durables = (f"state-repl-{self.node}-plan", f"state-repl-{self.node}-recovered")

    async def start(self) -> None:
        plan_durable, recovered_durable = self.durables
        # deliver_new: the current plan of a job is in the KV bucket; the stream is
        # for what happens from now on (and, once the consumer exists, across restarts).
        self.bus.consume(COMMANDS, plan_durable, [PLAN.wildcard()], self._on_plan, (Plan,), deliver_new=True)
        self.bus.consume(
            EVENTS,
            recovered_durable,
            [RECOVERED.wildcard()],
            self._on_recovered,
            (RecoveryDone,),
            deliver_new=True,
        )
        self.log.info("following", node=self.node, durables=list(self.durables))
        await self.keeper.start()

    async def stop(self) -> None:
        await self.keeper.stop()
        await super().stop()

    async def _on_plan(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, Plan)
        self.plans += 1
        view = self.jobs.setdefault(msg.job, JobView())
        span = trace.get_current_span()
        span.set_attribute("phalanx.job", msg.job)
        span.set_attribute("phalanx.generation", msg.generation)
        if not msg.supersedes(view.plan):
            self.stale += 1
            self.log.info("plan_stale", job=msg.job, generation=msg.generation, current=view.generation)
            return
        view.plan = msg
        view.members = {m.worker: m.rank for m in msg.members}
        view.recovered = set()
        self.log.info(
            "plan",
            job=msg.job,
            generation=msg.generation,
            world_size=msg.world_size,
            members=view.members,
            spares=msg.spares,
            removed=msg.removed,
            incident=msg.incident,
        )
        await self.on_plan(msg)

    async def _on_recovered(self, msg: Message, raw: Msg) -> None:
        assert isinstance(msg, RecoveryDone)
        self.recoveries += 1
        view = self.jobs.setdefault(msg.job, JobView())
        span = trace.get_current_span()
        span.set_attribute("phalanx.job", msg.job)
        span.set_attribute("phalanx.generation", msg.generation)
        if msg.generation == view.generation:
            view.recovered.add(msg.worker)
        self.log.info(
            "recovery_done",
            job=msg.job,
            generation=msg.generation,
            worker=msg.worker,
            rank=msg.rank,
            step=msg.step,
            incident=msg.incident,
            phases_ms=msg.phases_ms,
        )
        await self.on_recovery_done(msg)

    async def on_plan(self, plan: Plan) -> None:
        """A newer generation of ``plan.job`` was committed (hook for replication)."""

    async def on_recovery_done(self, done: RecoveryDone) -> None:
        """A rank completed its first step in a generation (hook for replication)."""

    def health_details(self) -> dict[str, str | int | float | bool]:
        return {
            "node": self.node,
            "jobs": len(self.jobs),
            "plans": self.plans,
            "stale_plans": self.stale,
            "recoveries": self.recoveries,
            "consumers": ",".join(self.durables),
            **self.keeper.health(),
        }
