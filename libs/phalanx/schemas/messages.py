"""Every event and command on the Phalanx bus.

Events say what happened (a rank exited, a rank is hung, a plan was decided);
commands say what to do (a plan for a new generation). A worker is a process
slot in a job (``w0``..``wN`` in a one-node job, ``<node>-w0``.. when the job may
span nodes; spares included); a rank is a worker's position in
the current generation's process group, and changes only through a plan.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from phalanx.schemas._base import JobMessage, Message, now

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
    RECOVERING = "recovering"
    DONE = "done"  # last heartbeat of a worker leaving cleanly: stop watching it


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
    pid: int
    host: str
    exit_code: int | None = None
    signal: int | None = None
    exited_at: float


class CollectiveError(JobMessage):
    """A rank's collective raised (peer closed the connection, timed out)."""

    KIND = "collective_error"
    worker: WorkerId
    rank: int
    generation: int
    step: int
    error: str = Field(max_length=2000)
    launch: str = Field(default="", max_length=64, description="The run the reporting rank belongs to.")


class FaultCause(StrEnum):
    PROCESS_EXIT = "process_exit"
    HEARTBEAT_LOST = "heartbeat_lost"
    STEP_STALL = "step_stall"
    COLLECTIVE_HANG = "collective_hang"


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

    @model_validator(mode="after")
    def _sizes(self) -> JobSpec:
        if self.min_nodes > self.max_nodes:
            raise ValueError("need min_nodes <= max_nodes")
        if self.ranks > len(self.workers):
            raise ValueError("more ranks than workers")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("a worker appears twice")
        return self

    def settings(self) -> dict[str, object]:
        """What every launcher of one run must agree on."""
        return {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "min_world_size": self.min_world_size,
            "global_batch": self.global_batch,
            "command": self.command,
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


class Plan(JobMessage):
    """Membership of one generation. Committed by the planner in KV (compare-and-set)
    before it is published; ranks ignore a plan whose generation is not newer."""

    KIND = "plan"
    generation: int = Field(ge=1)
    members: list[Member]
    spares: list[WorkerId] = Field(default_factory=list)
    removed: list[WorkerId] = Field(default_factory=list, description="Workers to fence (kill).")
    incident: str | None = None
    reason: str
    store_prefix: str = Field(description="Rendezvous prefix, unique per generation.")
    store_addr: str = Field(
        default="", max_length=300, description="host:port of the store this generation meets on."
    )
    launch: str = Field(default="", max_length=64, description="The job-level run this plan belongs to.")
    nodes: dict[WorkerId, NodeId] = Field(
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

    def rank_of(self, worker: WorkerId) -> int | None:
        return next((m.rank for m in self.members if m.worker == worker), None)


class JobRecord(JobMessage):
    """The one truth about a job: its committed plan and the planner's state, in the
    ``phalanx_jobs`` KV bucket under ``<job>.plan``. Written only by the planner
    leader, by compare-and-set on the revision its decision was computed from;
    ranks and launchers watch it and read only ``plan``."""

    KIND = "job_record"
    token: int = Field(ge=0, description="Fencing token of the planner leader that wrote it.")
    plan: Plan | None = None
    planner: dict[str, Any] = Field(
        default_factory=dict,
        description="The planner's own state (nodes, spares, lost workers): opaque to others.",
    )


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


class PlanDecision(JobMessage):
    """The planner's decision on an incident and why: observable by users' policies."""

    KIND = "plan_decision"
    incident: str | None
    action: Action
    reason: str
    generation: int | None = None


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


class CapacityChanged(Message):
    KIND = "capacity_changed"
    cluster: str
    available_slots: int = Field(ge=0)
    delta: int
    source: str
    ts: float = Field(default_factory=now)


class PreemptionNotice(Message):
    KIND = "preemption_notice"
    cluster: str
    job: str | None = None
    workers: list[WorkerId] = Field(default_factory=list)
    deadline_s: float = Field(ge=0)
    source: str
    ts: float = Field(default_factory=now)


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
