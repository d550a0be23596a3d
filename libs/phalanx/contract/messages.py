"""Every event and command on the Phalanx bus.

Events say what happened (a rank exited, a rank is hung, a plan was decided);
commands say what to do (a plan for a new generation). A worker is a process
slot in a job (``w0``..``wN`` in a one-node job, ``<node>-w0``.. when the job may
span nodes; spares included); a rank is a worker's position in
the current generation's process group, and changes only through a plan.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema, model_validator

from phalanx.contract._base import JobMessage, Message, now
from phalanx.contract.runs import Ints, Names, NodeMap, from_runs, to_runs

WorkerId = str
Evidence = dict[str, str | int | float | bool]


class Role(StrEnum):
    RANK = "rank"
    SPARE = "spare"


class Phase(StrEnum):
    """What a rank is doing when it heartbeats; lets the detector tell a stalled
    rank (stuck in compute) from its peers (blocked in a collective waiting on it)."""

    STARTING = "starting"
    IDLE = "idle"  # a hot spare waiting for an assignment
    COMPUTE = "compute"
    COLLECTIVE = "collective"
    RUNNING = "running"  # an unmodified script's rank out of its collectives, moving (still: COMPUTE)
    RECOVERING = "recovering"
    DONE = "done"  # last heartbeat of a worker leaving cleanly: stop watching it


MAX_STEP_RECORDS = 256
"""At most this many finished steps ride on one heartbeat (a datagram stays small)."""


class StepRecord(Message):
    """One optimizer step a rank completed: what ``phalanx report`` plots."""

    worker: WorkerId
    rank: int = Field(ge=0)
    generation: int = Field(ge=0)
    step: int = Field(ge=1, description="Optimizer steps completed, this one included.")
    step_ms: float = Field(ge=0, description="Wall time of the step on this rank.")
    loss: float | None = Field(default=None, description="The step's loss, if the training loop reported it.")
    at: float = Field(description="Wall time the step completed.")


class Heartbeat(JobMessage):
    """Published on core NATS every heartbeat interval by every rank and spare."""

    KIND = "heartbeat"
    worker: WorkerId
    rank: int = Field(ge=-1, description="-1 for a spare")
    generation: int = Field(ge=0)
    step: int = Field(ge=0, description="Optimizer steps completed.")
    step_ms: float = Field(ge=0, description="Duration of the last completed step.")
    phase: Phase
    phase_ms: float = Field(ge=0, description="How long the rank has been in this phase.")
    seq: int = Field(ge=0)
    pid: int
    host: str
    interval_ms: float = Field(gt=0)
    collective_bound_ms: float = Field(
        default=0.0,
        ge=0,
        description="The per-op timeout of the rank's current (or last) gradient all-reduce (0: none yet).",
    )
    op: int = Field(
        default=0,
        ge=0,
        description="Collectives of the current step the rank has entered (0: none yet): peers waiting"
        " in a later one of the step are owed it by a rank in compute short of it.",
    )
    loss: float | None = Field(default=None, description="Loss of the last completed step, if reported.")
    finished: list[StepRecord] = Field(
        default_factory=list,
        max_length=MAX_STEP_RECORDS,
        description="Steps completed since the last heartbeat that went out (the launcher persists them).",
    )
    plan: int = Field(
        default=0,
        ge=0,
        description="The newest plan generation this worker holds: its launcher acknowledges the node's"
        " members to the planner from it, and sends the plan again to one that is behind.",
    )


class Registered(JobMessage):
    """A worker process is up and ready (a rank, or a warm spare)."""

    KIND = "registered"
    worker: WorkerId
    role: Role
    host: str
    pid: int
    incarnation: int = Field(ge=0, default=0)
    launch: str = Field(default="", max_length=64, description="The launch that started the worker.")


class RankExited(JobMessage):
    """The launcher saw a worker process end: the fast crash path."""

    KIND = "rank_exited"
    worker: WorkerId
    node: str = Field(
        default="local",
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="The node whose launcher saw it (the subject's node; must run the worker).",
    )
    pid: int
    host: str
    exit_code: int | None = None
    signal: int | None = None
    exited_at: float
    generation: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Restart recovery: the generation the process ran the script for (a process per "
            "generation); its exit after a newer plan is no fault of that plan. None: the process "
            "lives across generations (in-process recovery) or is a spare."
        ),
    )


class CollectiveError(JobMessage):
    """A rank's collective raised (peer closed the connection, timed out)."""

    KIND = "collective_error"
    worker: WorkerId
    rank: int
    generation: int
    step: int
    error: str = Field(max_length=2000)
    launch: str = Field(default="", max_length=64, description="The run the reporting rank belongs to.")
    unrecoverable: bool = Field(
        default=False,
        description=(
            "The generation cannot go on whoever joins it: state no member holds (every replica "
            "of a shard lost, no checkpoint to load). The planner stops the job with ``error`` as "
            "its reason instead of re-forming or replacing."
        ),
    )


class FaultCause(StrEnum):
    PROCESS_EXIT = "process_exit"
    HEARTBEAT_LOST = "heartbeat_lost"
    STEP_STALL = "step_stall"
    COLLECTIVE_HANG = "collective_hang"
    COLLECTIVE_WEDGED = "collective_wedged"
    """Every member of the generation inside the same collective past its bound: the
    collective is stuck and no member can be singled out (the verdict names one of them;
    the default policy re-forms every member)."""


class _Fault(JobMessage):
    incident: str = Field(description="Stable id of the incident; also the Nats-Msg-Id.")
    worker: WorkerId
    rank: int
    generation: int
    cause: FaultCause
    fault_at: float = Field(description="When the detector infers the fault happened.")
    detected_at: float = Field(default_factory=now)
    evidence: Evidence = Field(default_factory=dict)


class RankFailed(_Fault):
    KIND = "rank_failed"


class RankHung(_Fault):
    KIND = "rank_hung"


NodeId = str
_NAME = r"^[A-Za-z0-9_-]+$"


class NodeLost(JobMessage):
    """The failure-detector's verdict on a whole node: its launcher's digests
    stopped (power, kernel, NIC, a partition). Every worker of the node is lost at
    once, so the planner replaces them in one generation."""

    KIND = "node_lost"
    incident: str = Field(description="Stable id of the incident; also the Nats-Msg-Id.")
    node: NodeId = Field(max_length=64, pattern=_NAME)
    launcher: str = Field(default="", max_length=64, description="The launcher whose digests stopped.")
    workers: list[WorkerId]
    cause: FaultCause
    fault_at: float = Field(description="When the detector infers the node went silent.")
    detected_at: float = Field(default_factory=now)
    evidence: Evidence = Field(default_factory=dict)


class DigestEntry(Message):
    """One local worker in a node digest: its own latest heartbeat as the launcher
    received it, and how long ago (the launcher's clock), so the detector can date it."""

    worker: WorkerId
    pid: int
    seq: int = Field(ge=0)
    rank: int = Field(ge=-1)
    generation: int = Field(ge=0)
    step: int = Field(ge=0)
    step_ms: float = Field(ge=0)
    phase: Phase
    phase_ms: float = Field(ge=0)
    age_ms: float = Field(ge=0, description="Time since the launcher received this heartbeat.")
    interval_ms: float = Field(
        default=0.0,
        ge=0,
        description="The worker's own heartbeat interval (0: unknown; the detector takes the digest's).",
    )
    collective_bound_ms: float = Field(
        default=0.0, ge=0, description="The heartbeat's collective_bound_ms (0: none reported)."
    )
    op: int = Field(default=0, ge=0, description="The heartbeat's op (0: none reported).")


class NodeDigest(JobMessage):
    """Published by each node's launcher every heartbeat interval on core NATS:
    the node is alive (its own sequence) and so is each local worker whose entry
    moved on. 2,000 nodes x 8 ranks are 2,000 messages per interval, not 16,000."""

    KIND = "node_digest"
    node: NodeId = Field(max_length=64, pattern=_NAME)
    launcher: str = Field(min_length=1, max_length=64)
    host: str
    seq: int = Field(ge=0)
    interval_ms: float = Field(gt=0)
    entries: list[DigestEntry] = Field(default_factory=list)


class StepStats(JobMessage):
    """Published on JetStream by each node's launcher about once a second: the steps
    its ranks completed since the last one, so a run's step times and losses can be
    read (``phalanx report``) after the job has ended."""

    KIND = "step_stats"
    node: NodeId = Field(max_length=64, pattern=_NAME)
    launcher: str = Field(min_length=1, max_length=64)
    seq: int = Field(ge=0, description="Per launcher; with it, the message's Nats-Msg-Id.")
    steps: list[StepRecord] = Field(max_length=4096)


class Recovery(StrEnum):
    """How a job's workers go on after a change of members.

    ``in_process``: the script uses Phalanx (``phalanx.runtime``); survivors stay alive
    and re-form. ``restart``: an unmodified torchrun script; every member of the new
    generation is a fresh (warm) process that resumes from the script's own checkpoint.
    """

    IN_PROCESS = "in_process"
    RESTART = "restart"


class LrRule(StrEnum):
    """How the learning rate follows the effective batch when the global batch
    cannot be held: ``lr * 1``, ``lr * E/G`` or ``lr * sqrt(E/G)``."""

    NONE = "none"
    LINEAR = "linear"
    SQRT = "sqrt"


class Elastic(Message):
    """A job's elasticity: the sizes it may take and how it changes size.

    ``max_world_size`` 0 keeps the job at the size it started with (spares only
    replace lost ranks); above it, registered spares grow the job up to it. A
    world size must be one of ``sizes`` when given, and a multiple of ``size_step``.
    ``micro_batch`` x ``max_accum`` caps what one replica trains per step (0: no
    cap); when the global batch does not fit under the cap, each replica trains
    its capped share and the learning rate follows ``lr_rule``.

    ``group_size`` > 1 is a sharded model's (FSDP2, HSDP): ranks come in replica
    groups of that many, rank ``r`` holding shard ``r % group_size``. The job then
    grows and shrinks by whole groups only, and a rank keeps its shard for life
    (a shrink drops the groups that lost a member instead of renumbering ranks
    across groups).
    """

    max_world_size: int = Field(
        default=0, ge=0, description="Largest world a grow may reach (0: the start world)."
    )
    sizes: list[int] = Field(
        default_factory=list, max_length=256, description="Allowed world sizes (empty: any)."
    )
    size_step: int = Field(default=1, ge=1, description="World sizes must be multiples of this.")
    cooldown_s: float = Field(default=10.0, ge=0, description="No grow sooner than this after a change.")
    grace_s: float = Field(default=30.0, ge=0, description="Time leaving ranks get when a notice gives none.")
    micro_batch: int = Field(default=0, ge=0, description="Samples per forward of one replica (0: unknown).")
    max_accum: int = Field(
        default=0, ge=0, description="Most micro-batches per replica per step (0: no cap)."
    )
    lr_rule: LrRule = LrRule.NONE
    auto_grow: bool = Field(
        default=True,
        description="The planner grows on its own; False: only a policy's proposals grow the job.",
    )
    group_size: int = Field(
        default=1,
        ge=1,
        le=65536,
        description="Ranks per replica group of a sharded model (its shard count); 1: replicated (DDP).",
    )

    @model_validator(mode="after")
    def _valid(self) -> Elastic:
        if any(n < 1 for n in self.sizes):
            raise ValueError(f"allowed sizes must be >= 1, got {self.sizes}")
        if self.max_accum and not self.micro_batch:
            raise ValueError("max_accum needs micro_batch")
        if self.max_world_size % self.group_size:
            raise ValueError(
                f"max_world_size {self.max_world_size} is no multiple of group_size {self.group_size}"
            )
        if bad := [n for n in self.sizes if n % self.group_size]:
            raise ValueError(f"allowed sizes {bad} are no multiples of group_size {self.group_size}")
        return self

    def allowed(self, world: int) -> bool:
        return (
            world >= 1
            and world % self.size_step == 0
            and world % self.group_size == 0
            and (not self.sizes or world in self.sizes)
        )


class BatchPlan(Message):
    """How a generation splits the global batch: per replica ``shards[r]`` samples in
    micro-batches of ``micro_batch``; ``effective_batch`` < ``global_batch`` when the
    per-replica cap cut it, with the learning rate scaled by ``lr_scale``."""

    global_batch: int = Field(ge=1)
    effective_batch: int = Field(ge=1)
    world_size: int = Field(ge=1)
    shards: Ints = Field(description="Samples each rank trains per step (run-length on the wire).")
    micro_batch: int = Field(default=0, ge=0)
    accum: int = Field(default=1, ge=1, description="Micro-batches of the largest shard.")
    lr_rule: LrRule = LrRule.NONE
    lr_scale: float = Field(default=1.0, gt=0)

    @property
    def held(self) -> bool:
        return self.effective_batch == self.global_batch

    def describe(self) -> str:
        per = "/".join(str(n) for n in sorted(set(self.shards), reverse=True))
        how = f"{self.world_size} replicas x {per} samples"
        if self.micro_batch:
            how += f" ({self.accum} micro-batch(es) of {self.micro_batch})"
        if self.held:
            return f"global batch {self.global_batch} held: {how}"
        return (
            f"global batch {self.global_batch} cannot be held at {self.world_size} replicas "
            f"(cap {self.micro_batch}x{max(1, self.accum)} per replica): effective batch "
            f"{self.effective_batch}, lr x {self.lr_scale:.4g} ({self.lr_rule.value})"
        )


class JobSpec(JobMessage):
    """One node's launcher asks to join a job (``phalanx run`` on that node).

    The job-level settings (``min_nodes``..``max_nodes``, ``min_world_size``,
    ``global_batch``, ``command``) must agree with those of the nodes already in
    the job; the planner refuses a launcher that disagrees (:class:`NodeJoined`
    with ``accepted=False`` and the reason) and changes nothing. The first
    ``ranks`` of ``workers`` start as ranks, the rest as hot spares; a node that
    joins a running job brings spare capacity only.
    """

    KIND = "job_spec"
    node: NodeId = Field(default="local", max_length=64, pattern=_NAME, description="The node's name.")
    launcher: str = Field(min_length=1, max_length=64, description="Id of this launcher process.")
    host: str = Field(default="", max_length=255)
    store_addr: str = Field(
        default="", max_length=300, description="host:port of the rendezvous store this launcher hosts."
    )
    workers: list[WorkerId] = Field(min_length=1)
    ranks: int = Field(ge=0, description="How many of ``workers`` start as ranks.")
    min_nodes: int = Field(default=1, ge=1)
    max_nodes: int = Field(default=1, ge=1)
    min_world_size: int = Field(
        default=0, ge=0, description="Smallest world a shrink may leave; 0: the world it started with."
    )
    global_batch: int = Field(ge=1)
    command: str = Field(default="", max_length=128, description="Fingerprint of the training command.")
    elastic: Elastic = Field(default_factory=lambda: Elastic(), description="How the job grows and shrinks.")
    recovery: Recovery = Field(default=Recovery.IN_PROCESS, description="How workers go on after a change.")
    max_restarts: int = Field(
        default=-1,
        ge=-1,
        description="Faults the job recovers from before it stops (torchrun's --max-restarts; -1: no limit).",
    )

    @model_validator(mode="after")
    def _sizes(self) -> JobSpec:
        if self.min_nodes > self.max_nodes:
            raise ValueError("need min_nodes <= max_nodes")
        if self.min_world_size % self.elastic.group_size:
            raise ValueError(
                f"min_world_size {self.min_world_size} is no multiple of group_size {self.elastic.group_size}"
            )
        if self.ranks > len(self.workers):
            raise ValueError("more ranks than workers")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("a worker appears twice")
        e = self.elastic
        if e.max_world_size and self.min_world_size > e.max_world_size:
            raise ValueError(f"min_world_size {self.min_world_size} > max_world_size {e.max_world_size}")
        if e.max_world_size and e.max_world_size > self.global_batch:
            raise ValueError(f"max_world_size {e.max_world_size} > global_batch {self.global_batch}")
        return self

    def settings(self) -> dict[str, object]:
        """What every launcher of one run must agree on."""
        return {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "min_world_size": self.min_world_size,
            "global_batch": self.global_batch,
            "command": self.command,
            "elastic": self.elastic.model_dump(mode="json"),
            "recovery": self.recovery.value,
            "max_restarts": self.max_restarts,
        }


class NodeJoined(JobMessage):
    """The planner's answer to a :class:`JobSpec`: accepted into run ``run``, or refused."""

    KIND = "node_joined"
    node: NodeId = Field(max_length=64, pattern=_NAME)
    launcher: str = Field(min_length=1, max_length=64)
    accepted: bool
    run: str = Field(default="", max_length=64, description="The job-level run id ranks filter plans by.")
    as_spares: bool = Field(default=False, description="The job is running: start every worker as a spare.")
    workers: list[WorkerId] = Field(
        default_factory=list, description="The names to start the workers under (unique in the run)."
    )
    reason: str = Field(default="", max_length=2000)
    retry: bool = Field(
        default=False, description="Refused for now (the node's old launcher is not yet declared lost)."
    )


class Member(Message):
    rank: int = Field(ge=0)
    worker: WorkerId


def _members_in(value: Any) -> Any:
    """Runs of names in rank order (the wire), or Member objects / dicts (code, old payloads)."""
    if isinstance(value, list | tuple) and value and all(isinstance(v, list | tuple | str) for v in value):
        return [{"rank": r, "worker": w} for r, w in enumerate(from_runs(value))]
    return value


def _members_out(members: list[Member]) -> list[list[Any]]:
    return to_runs(m.worker for m in sorted(members, key=lambda m: m.rank))


Members = Annotated[
    list[Member],
    BeforeValidator(_members_in),
    PlainSerializer(_members_out, when_used="json"),
    WithJsonSchema(
        {
            "type": "array",
            "description": "the members in rank order, as runs of names: [prefix, first, count]"
            " (rank r is the r-th name); a list of {rank, worker} is also read",
            "items": {"type": "array"},
        }
    ),
]


class Plan(JobMessage):
    """Membership of one generation. Committed by the planner in KV (compare-and-set)
    before it is published. Receivers keep the newest (``supersedes``): the higher fencing
    token wins, then the higher generation."""

    KIND = "plan"
    SCHEMA_VERSION = 2  # 2: runs of names for members, spares, nodes (runs.py); zlib
    COMPRESSED = True
    generation: int = Field(ge=1)
    members: Members
    spares: Names = Field(default_factory=list)
    removed: Names = Field(default_factory=list, description="Workers to fence (kill).")
    incident: str | None = None
    reason: str
    store_prefix: str = Field(description="Rendezvous prefix, unique per generation.")
    store_secret: str = Field(
        default="",
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]*$",
        repr=False,
        description="This generation's rendezvous secret: members keep their store keys under it, so"
        " whoever learns store_addr and store_prefix but not the plan cannot read or write them."
        " Random per generation; only the job's users and the services can read a plan. Never logged."
        " Empty: a plan of a planner from before it (keys under store_prefix alone).",
    )
    store_addr: str = Field(
        default="", max_length=300, description="host:port of the store this generation meets on."
    )
    store_addrs: list[Annotated[str, Field(max_length=300)]] = Field(
        default_factory=list,
        max_length=64,
        description="Other launchers' stores (host:port) a large generation's bootstrap keys are spread"
        " over by hash (phalanx.runtime.rendezvous); store_addr stays the root and holds the arrival"
        " counter. Empty: every key on store_addr.",
    )
    launch: str = Field(default="", max_length=64, description="The job-level run this plan belongs to.")
    group_size: int = Field(
        default=1, ge=1, le=65536, description="Ranks per replica group (the job's elastic.group_size)."
    )
    nodes: NodeMap = Field(
        default_factory=dict, description="The node of every member and spare (worker -> node)."
    )
    lost_launchers: list[str] = Field(
        default_factory=list,
        description="Launchers of this run whose node was declared lost: they fence their workers and end.",
    )
    lost_hosts: list[str] = Field(
        default_factory=list,
        description="Addresses of those nodes (none shared with a live node): ranks cut their connections to them.",
    )
    token: int = Field(
        default=0,
        ge=0,
        description="Fencing token of the planner leader that committed it: ranks refuse a lower one.",
    )
    trace: dict[str, str] = Field(
        default_factory=dict,
        max_length=4,
        description="W3C trace context of the incident (traceparent), for whoever reads the plan from KV.",
    )
    planned: bool = Field(
        default=False,
        description="A resize at a step boundary: members switch after the step whose all-reduce says so.",
    )
    leaving: Names = Field(
        default_factory=list,
        description="Workers that leave gracefully: finish the step, exit 0; fenced only after leave_by.",
    )
    leave_by: float = Field(
        default=0.0, ge=0, description="Wall time after which leaving workers are fenced."
    )
    batch: BatchPlan | None = Field(default=None, description="How this generation splits the global batch.")
    shrunk: list[int] = Field(
        default_factory=list,
        max_length=4096,
        description="When this generation is exactly the previous one's members minus some, in the same"
        " order, with no one joining: the previous generation's ranks left out (an NCCL communicator may"
        " then be shrunk instead of built again). Empty otherwise.",
    )

    @model_validator(mode="after")
    def _dense(self) -> Plan:
        ranks = sorted(m.rank for m in self.members)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"ranks must be 0..n-1, got {ranks}")
        workers = [m.worker for m in self.members]
        if len(set(workers)) != len(workers):
            raise ValueError("a worker appears twice in members")
        return self

    @property
    def world_size(self) -> int:
        return len(self.members)

    def supersedes(self, other: Plan | None) -> bool:
        """Whether this plan replaces ``other``, the newest one a receiver holds (None: it holds none).

        The one answer to "is this plan newer than what I have?" for every receiver of plans:
        the worker agent, the launcher, the detector, state-replication, the policy client.
        The order, within one job (plans of two jobs are never compared: ``ValueError``):

        1. the higher fencing ``token`` wins: the token is the KV revision at which the planner
           leader that committed the plan acquired its lease, and revisions only grow, so a
           later leader's plan replaces any of a deposed leader's, whatever its generation
           (a planner that still thinks it leads cannot override its successor);
        2. within one token the higher ``generation`` wins: one leader commits a job's
           generations in order, by compare-and-set on the job's record;
        3. the same (token, generation) is the same plan (a re-send, or read again from KV):
           it does not supersede, and neither does an older one.

        Runs: a job's runs continue its generations (a run starts from the job's last one) and
        the token never decreases, so a newer run's plans supersede an older run's by this same
        order. A run id (``launch``) is random, not ordered, and is not compared here: whoever
        follows one run only (the agent, the launcher) first ignores the plans of other runs.

        A receiver keeps a plan when ``plan.supersedes(held)``; one that re-applies the plan it
        holds (idempotent) keeps it unless ``held.supersedes(plan)``. A new leader continues
        from the generation in the job's record, so of two committed plans the superseding one
        also has the higher generation: a rank may count its progress in generations.
        """
        if other is None:
            return True
        if other.job != self.job:
            raise ValueError(f"plans of jobs {self.job!r} and {other.job!r} are not ordered")
        return (self.token, self.generation) > (other.token, other.generation)

    def rank_of(self, worker: WorkerId) -> int | None:
        return next((m.rank for m in self.members if m.worker == worker), None)


class Action(StrEnum):
    START = "start"
    REPLACE = "replace"
    SHRINK = "shrink"
    GROW = "grow"
    REFORM = "reform"  # same members, new generation: the group broke but nobody died
    HOLD = "hold"
    STOP = "stop"
    JOIN = "join"  # a node joined the job (its workers are ranks or spares)
    COMPLETE = "complete"  # the members finished: launchers end, spares leave
    SPAWN = "spawn"  # a launcher is asked to start workers (refill spares, use offered capacity)
    REJECT = "reject"  # a policy's proposal was refused


class PlanDecision(JobMessage):
    """The planner's decision on an incident and why: observable by users' policies."""

    KIND = "plan_decision"
    incident: str | None
    action: Action
    reason: str
    generation: int | None = None
    world_size: int | None = Field(default=None, description="The world size the decision leads to.")
    proposal: str | None = Field(default=None, description="The proposal this decision answers.")
    batch: BatchPlan | None = Field(default=None, description="The new generation's batch split.")


class PlanAck(JobMessage):
    KIND = "plan_ack"
    generation: int
    worker: WorkerId
    rank: int


class RecoveryDone(JobMessage):
    """A rank finished its first step in a new generation; carries its phase times."""

    KIND = "recovery_done"
    generation: int
    worker: WorkerId
    rank: int
    step: int
    incident: str | None
    phases_ms: dict[str, float]
    bytes_received: int = Field(
        default=0, ge=0, description="state bytes this rank received from a peer in the recovery (0: none)"
    )


CopyState = Literal["complete", "corrupt", "deleted", "failed", "served", "skipped"]


class CheckpointEvent(JobMessage):
    """A checkpoint copy changed state in a tier (keeper: state-replication).

    ``state``: ``complete`` (the copy and its manifest are there), ``corrupt`` (its
    bytes fail the manifest's checksums; it is being repaired), ``deleted``
    (retention), ``failed`` (a write or fetch did not finish; ``detail`` says why),
    ``served`` (a restore read it: ``tier`` says from where), ``skipped`` (a rank's save
    of ``step`` was not taken: every slot held, or no room in shared memory; ``detail``).
    """

    KIND = "checkpoint"
    step: int = Field(ge=0)
    tier: Literal["memory", "disk", "shared", "object"]
    state: CopyState
    node: NodeId
    bytes: int = Field(ge=0)
    seconds: float = Field(default=0.0, ge=0)
    detail: str = Field(default="", max_length=500)


class CapacityChanged(Message):
    """Capacity changed in a cluster. ``offered`` (the local cluster) gives, per node,
    the worker slots offered beyond what its launchers started with: the planner may
    ask those launchers to start that many more workers."""

    KIND = "capacity_changed"
    cluster: str
    available_slots: int = Field(ge=0)
    delta: int
    source: str
    ts: float = Field(default_factory=now)
    offered: dict[NodeId, int] = Field(
        default_factory=dict, description="Slots offered per node (local cluster)."
    )


class PreemptionNotice(Message):
    """The scheduler takes ``workers`` (or every worker on ``nodes``) back within ``deadline_s``."""

    KIND = "preemption_notice"
    cluster: str
    job: str | None = None
    workers: list[WorkerId] = Field(default_factory=list)
    nodes: list[NodeId] = Field(default_factory=list, description="Nodes reclaimed: every worker on them.")
    deadline_s: float = Field(ge=0)
    source: str
    reason: str = Field(default="", max_length=500)
    ts: float = Field(default_factory=now)


class SpawnWorkers(JobMessage):
    """The planner asks a node's launcher to start workers (as hot spares)."""

    KIND = "spawn_workers"
    node: NodeId = Field(max_length=64, pattern=_NAME)
    launcher: str = Field(min_length=1, max_length=64)
    run: str = Field(max_length=64)
    workers: list[WorkerId] = Field(min_length=1)
    reason: str = Field(default="", max_length=500)


class Proposal(JobMessage):
    """A custom policy asks the planner to take the job to ``world_size``.

    The planner validates it (min/max, allowed sizes, spares at hand, the job
    running) and answers with a :class:`PlanDecision` naming ``id``: GROW/SHRINK
    with the new generation, or REJECT with the reason.
    """

    KIND = "proposal"
    id: str = Field(min_length=1, max_length=64, pattern=_NAME)
    policy: str = Field(min_length=1, max_length=64)
    world_size: int = Field(ge=1)
    reason: str = Field(default="", max_length=500)


class ErrorEvent(Message):
    """Bad input met by a service: what it was, where, and why it was refused."""

    KIND = "error"
    service: str
    subject: str
    reason: str = Field(max_length=4000)
    kind: str | None = None
    ts: float = Field(default_factory=now)


class HealthReply(Message):
    KIND = "health"
    service: str
    status: Literal["ok", "degraded"]
    uptime_s: float
    instance: str
    details: dict[str, str | int | float | bool] = Field(default_factory=dict)


class Ping(Message):
    KIND = "ping"
    ts: float = Field(default_factory=now)
