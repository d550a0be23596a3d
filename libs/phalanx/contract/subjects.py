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

from phalanx.contract import (
    CapacityChanged,
    CheckpointEvent,
    CollectiveError,
    ErrorEvent,
    HealthReply,
    Heartbeat,
    JobSpec,
    Message,
    NodeAck,
    NodeDigest,
    NodeJoined,
    NodeLost,
    Plan,
    PlanAck,
    PlanDecision,
    PlanDelta,
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
    "phalanx.evt.{job}.registered.{worker}",
    Registered,
    Transport.JETSTREAM,
    "A worker process is warm and ready (sent by that worker only).",
)
EXITED = Subject(
    "phalanx.evt.{job}.exited.{node}",
    RankExited,
    Transport.JETSTREAM,
    "The launcher of the node running the worker saw its process end (fast crash path).",
)
COMM_ERROR = Subject(
    "phalanx.evt.{job}.comm_error.{worker}",
    CollectiveError,
    Transport.JETSTREAM,
    "A rank's collective raised (sent by that rank only).",
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
ACK = Subject(
    "phalanx.evt.{job}.ack.{worker}",
    PlanAck,
    Transport.JETSTREAM,
    "A member acknowledged a plan (sent by that member only).",
)
RECOVERED = Subject(
    "phalanx.evt.{job}.recovered.{worker}",
    RecoveryDone,
    Transport.JETSTREAM,
    "A rank completed its first step in a new generation (sent by that rank only).",
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
    "phalanx.cmd.{job}.spec.{node}",
    JobSpec,
    Transport.JETSTREAM,
    "A job's size limits, batch and workers, from the launcher of that node.",
)
PLAN = Subject(
    "phalanx.cmd.{job}.plan",
    Plan,
    Transport.JETSTREAM,
    "A committed plan: the membership of a new generation.",
)
DELTA = Subject(
    "phalanx.cmd.{job}.delta",
    PlanDelta,
    Transport.JETSTREAM,
    "A committed plan as a change of the one before: what launchers follow (one message whatever the job's size).",
)
NODE_ACK = Subject(
    "phalanx.evt.{job}.node_ack.{node}",
    NodeAck,
    Transport.JETSTREAM,
    "A node's launcher: these of its workers hold a generation (sent by that node's launcher only).",
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
INSTANCE_HEALTH = Subject(
    "phalanx.health.{service}.{instance}",
    HealthReply,
    Transport.REQUEST,
    "Ask one instance of a service how it is (request: Ping). The server answers 'no responders'"
    " once that instance's connection is gone: a standby planner asks the lease holder.",
)
NODE_PROBE = Subject(
    "phalanx.node.{job}.{node}.ping",
    HealthReply,
    Transport.REQUEST,
    "Ask a node's launcher whether it is there (request: Ping; its reply names the launcher)."
    " The server answers 'no responders' once that launcher's connection is gone: the"
    " failure-detector asks the nodes of a mass silence before any verdict on them.",
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
    NODE_ACK,
    RECOVERED,
    STEPS,
    CHECKPOINT,
    JOB_SPEC,
    PLAN,
    DELTA,
    SPAWN,
    PROPOSAL,
    CAPACITY,
    PREEMPT,
    ERROR,
    HEALTH,
    INSTANCE_HEALTH,
    NODE_PROBE,
)


def subject_job(subject: str) -> str | None:
    """The job a job-scoped subject names (``phalanx.<kind>.<job>...``), else None.

    >>> subject_job("phalanx.evt.j1.comm_error.w0")
    'j1'
    """
    m = _JOB_SCOPED.match(subject)
    return m.group(1) if m else None


Shape = tuple[Subject, list[tuple[int, str]], list[tuple[int, str]]]


def _shapes() -> dict[tuple[int, str], list[Shape]]:
    """The catalogue by shape (number of tokens, second token): each pattern with the
    positions of its constant tokens and of its parameters (a lookup per message)."""
    out: dict[tuple[int, str], list[Shape]] = {}
    for s in CATALOGUE:
        parts = s.pattern.split(".")
        fixed = [(i, p) for i, p in enumerate(parts) if not p.startswith("{")]
        params = [(i, p[1:-1]) for i, p in enumerate(parts) if p.startswith("{")]
        out.setdefault((len(parts), parts[1]), []).append((s, fixed, params))
    return out


_SHAPES = _shapes()

# The tokens that name who a message speaks for: a payload field of the same name must agree.
BOUND_TOKENS = ("job", "worker", "node")


def subject_tokens(subject: str) -> tuple[Subject, dict[str, str]] | None:
    """The catalogue subject ``subject`` is an instance of, and its tokens; None if none.

    >>> s, tokens = subject_tokens("phalanx.evt.j1.ack.w0")
    >>> s.pattern, tokens
    ('phalanx.evt.{job}.ack.{worker}', {'job': 'j1', 'worker': 'w0'})
    """
    parts = subject.split(".")
    if len(parts) < 2:
        return None
    for s, fixed, params in _SHAPES.get((len(parts), parts[1]), ()):
        if all(parts[i] == p for i, p in fixed):
            return s, {name: parts[i] for i, name in params}
    return None


def sender_mismatch(subject: str, msg: Message) -> str | None:
    """Why ``msg`` may not travel on ``subject``, or None.

    Credentials are scoped by subject: a job's users publish only on that job's
    subjects, a worker's only on its own ``...<worker>`` subjects, a node's launcher
    only on its own ``...<node>`` subjects (:mod:`phalanx.natsauth`). A payload that
    names another job, worker or node than its subject would let a publisher allowed
    to speak for one act for another, so every receiver refuses it as bad input
    (:class:`phalanx.bus.Bus` does, for everything it decodes).

    >>> from phalanx.contract import PlanAck
    >>> sender_mismatch("phalanx.evt.j1.ack.w1", PlanAck(job="j1", generation=1, worker="w0", rank=0))
    "ack of worker 'w0' on phalanx.evt.j1.ack.w1 (worker 'w1')"
    """
    found = subject_tokens(subject)
    if found is None:  # not in the catalogue: only the job, if the subject names one
        job = subject_job(subject)
        tokens = {} if job is None else {"job": job}
    else:
        tokens = found[1]
    for name in BOUND_TOKENS:
        claimed = getattr(msg, name, None)
        token = tokens.get(name)
        if token is not None and isinstance(claimed, str) and claimed != token:
            return f"{msg.KIND} of {name} {claimed!r} on {subject} ({name} {token!r})"
    return None
