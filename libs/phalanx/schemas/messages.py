"""Every event and command on the Phalanx bus.

Events say what happened (a rank exited, a rank is hung, a plan was decided);
commands say what to do (a plan for a new generation). A worker is a process
slot in a job (``w0``..``wN``, spares included); a rank is a worker's position in
the current generation's process group, and changes only through a plan.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

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


class FaultCause(StrEnum):
    PROCESS_EXIT = "process_exit"
    HEARTBEAT_LOST = "heartbeat_lost"
    STEP_STALL = "step_stall"


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


class JobSpec(JobMessage):
    """What the launcher asks of the planner for a job."""

    KIND = "job_spec"
    world_size: int = Field(ge=1)
    min_world_size: int = Field(ge=1)
    max_world_size: int = Field(ge=1)
    global_batch: int = Field(ge=1)
    workers: list[WorkerId]
    launch: str = Field(default="", max_length=64, description="Id of this launch of the job.")

    @model_validator(mode="after")
    def _sizes(self) -> JobSpec:
        if not self.min_world_size <= self.world_size <= self.max_world_size:
            raise ValueError("need min_world_size <= world_size <= max_world_size")
        if len(self.workers) < self.world_size:
            raise ValueError("fewer workers than world_size")
        return self


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
    launch: str = Field(default="", max_length=64, description="The launch this plan belongs to.")

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


class Action(StrEnum):
    START = "start"
    REPLACE = "replace"
    SHRINK = "shrink"
    GROW = "grow"
    REFORM = "reform"  # same members, new generation: the group broke but nobody died
    HOLD = "hold"
    STOP = "stop"


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
