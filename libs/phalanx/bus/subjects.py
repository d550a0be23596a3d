"""The subject catalogue: every subject, its transport, and what it carries.

This table is the wire contract. ``proto/`` is generated from it and a test
checks the two agree. Tokens in braces are filled per message; a subscriber
uses ``*`` in their place.

>>> HEARTBEAT.format(job="j1", worker="w0")
'phalanx.hb.j1.w0'
>>> HEARTBEAT.wildcard()
'phalanx.hb.*.*'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from phalanx.schemas import (
    CapacityChanged,
    CheckpointEvent,
    CollectiveError,
    ErrorEvent,
    HealthReply,
    Heartbeat,
    JobSpec,
    Message,
    NodeDigest,
    NodeJoined,
    NodeLost,
    Plan,
    PlanAck,
    PlanDecision,
    PreemptionNotice,
    Proposal,
    RankExited,
    RankFailed,
    RankHung,
    RecoveryDone,
    Registered,
    SpawnWorkers,
    StepStats,
)

_TOKEN = re.compile(r"\{([a-z_]+)\}")
_JOB_SCOPED = re.compile(r"^phalanx\.(?:hb|node|evt|cmd)\.([^.]+)\.")
_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


class Transport(StrEnum):
    CORE = "core"  # ephemeral: lost if nobody listens
    JETSTREAM = "jetstream"  # persisted in a stream, consumed by durable consumers
    REQUEST = "request"  # core request/reply


@dataclass(frozen=True)
class Subject:
    pattern: str
    message: type[Message]
    transport: Transport
    description: str

    @property
    def params(self) -> list[str]:
        return _TOKEN.findall(self.pattern)

    def format(self, **tokens: str) -> str:
        """Fill the tokens; each must be a plain name (no dots, wildcards or spaces)."""
        missing = set(self.params) - tokens.keys()
        if missing:
            raise ValueError(f"{self.pattern}: missing {sorted(missing)}")
        self._check(tokens)
        return _TOKEN.sub(lambda m: tokens[m.group(1)], self.pattern)

    def wildcard(self, **tokens: str) -> str:
        """The pattern with the given tokens filled and the rest as ``*``."""
        self._check(tokens)
        return _TOKEN.sub(lambda m: tokens.get(m.group(1), "*"), self.pattern)

    def _check(self, tokens: dict[str, str]) -> None:
        for k, v in tokens.items():
            if not _SAFE.match(v):
                raise ValueError(f"{self.pattern}: token {k}={v!r} is not a plain name")


HEARTBEAT = Subject(
    "phalanx.hb.{job}.{worker}",
    Heartbeat,
    Transport.CORE,
    "Liveness and progress of a rank or spare, every heartbeat interval.",
)
NODE_DIGEST = Subject(
    "phalanx.node.{job}.{node}",
    NodeDigest,
    Transport.CORE,
    "A node's launcher, every heartbeat interval: the node and each local worker's latest heartbeat.",
)
REGISTERED = Subject(
    "phalanx.evt.{job}.registered", Registered, Transport.JETSTREAM, "A worker process is warm and ready."
)
EXITED = Subject(
    "phalanx.evt.{job}.exited",
    RankExited,
    Transport.JETSTREAM,
    "The launcher saw a worker process end (fast crash path).",
)
COMM_ERROR = Subject(
    "phalanx.evt.{job}.comm_error", CollectiveError, Transport.JETSTREAM, "A rank's collective raised."
)
FAILED = Subject(
    "phalanx.evt.{job}.failed",
    RankFailed,
    Transport.JETSTREAM,
    "The failure-detector's verdict: a rank crashed.",
)
HUNG = Subject(
    "phalanx.evt.{job}.hung", RankHung, Transport.JETSTREAM, "The failure-detector's verdict: a rank is hung."
)
DECISION = Subject(
    "phalanx.evt.{job}.decision",
    PlanDecision,
    Transport.JETSTREAM,
    "The planner's decision on an incident and its reason.",
)
NODE_LOST = Subject(
    "phalanx.evt.{job}.node_lost",
    NodeLost,
    Transport.JETSTREAM,
    "The failure-detector's verdict: a whole node went silent.",
)
JOINED = Subject(
    "phalanx.evt.{job}.joined",
    NodeJoined,
    Transport.JETSTREAM,
    "The planner's answer to a node's job spec: accepted (with the run id) or refused.",
)
ACK = Subject("phalanx.evt.{job}.ack", PlanAck, Transport.JETSTREAM, "A member acknowledged a plan.")
RECOVERED = Subject(
    "phalanx.evt.{job}.recovered",
    RecoveryDone,
    Transport.JETSTREAM,
    "A rank completed its first step in a new generation.",
)
STEPS = Subject(
    "phalanx.evt.{job}.steps",
    StepStats,
    Transport.JETSTREAM,
    "A node's launcher, about once a second: the steps its ranks completed (step time, loss).",
)
CHECKPOINT = Subject(
    "phalanx.evt.{job}.checkpoint",
    CheckpointEvent,
    Transport.JETSTREAM,
    "A checkpoint copy became complete, corrupt, deleted or failed in a tier, or served a restore.",
)
JOB_SPEC = Subject(
    "phalanx.cmd.{job}.spec",
    JobSpec,
    Transport.JETSTREAM,
    "A job's size limits, batch and workers, from its launcher.",
)
PLAN = Subject(
    "phalanx.cmd.{job}.plan",
    Plan,
    Transport.JETSTREAM,
    "A committed plan: the membership of a new generation.",
)
SPAWN = Subject(
    "phalanx.cmd.{job}.spawn",
    SpawnWorkers,
    Transport.JETSTREAM,
    "The planner asks a node's launcher to start workers (hot spares).",
)
PROPOSAL = Subject(
    "phalanx.cmd.{job}.proposal",
    Proposal,
    Transport.JETSTREAM,
    "A custom policy proposes a world size; the planner commits or rejects it.",
)
CAPACITY = Subject(
    "phalanx.sched.{cluster}.capacity",
    CapacityChanged,
    Transport.JETSTREAM,
    "Free capacity changed in a cluster.",
)
PREEMPT = Subject(
    "phalanx.sched.{cluster}.preempt",
    PreemptionNotice,
    Transport.JETSTREAM,
    "The scheduler wants capacity back.",
)
ERROR = Subject("phalanx.err.{service}", ErrorEvent, Transport.JETSTREAM, "A service refused bad input.")
HEALTH = Subject(
    "phalanx.health.{service}",
    HealthReply,
    Transport.REQUEST,
    "Ask a service how it is (request: Ping, reply: HealthReply).",
)

CATALOGUE: tuple[Subject, ...] = (
    HEARTBEAT,
    NODE_DIGEST,
    REGISTERED,
    EXITED,
    COMM_ERROR,
    FAILED,
    HUNG,
    NODE_LOST,
    DECISION,
    JOINED,
    ACK,
    RECOVERED,
    STEPS,
    CHECKPOINT,
    JOB_SPEC,
    PLAN,
    SPAWN,
    PROPOSAL,
    CAPACITY,
    PREEMPT,
    ERROR,
    HEALTH,
)


def subject_job(subject: str) -> str | None:
    """The job a job-scoped subject names (``phalanx.<kind>.<job>...``), else None.

    >>> subject_job("phalanx.evt.j1.comm_error")
    'j1'
    """
    m = _JOB_SCOPED.match(subject)
    return m.group(1) if m else None


def job_mismatch(subject: str, msg: Message) -> str | None:
    """Why ``msg`` may not travel on ``subject`` (its payload names another job), or None.

    Credentials are scoped by subject; a payload naming another job than its
    subject would let a publisher allowed into one job act on another.
    """
    job = subject_job(subject)
    claimed = getattr(msg, "job", None)
    if job is None or claimed is None or claimed == job:
        return None
    return f"{msg.KIND} of job {claimed!r} on {subject} (job {job!r})"
