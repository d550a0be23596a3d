"""What a step of the planner asks the world to do, as data.

The reducer (:mod:`.reducer`) returns these; the service runs them in order once
the job's record is committed (:mod:`.runner`). Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.contract import NodeJoined, PlanDecision, SpawnWorkers


@dataclass(frozen=True)
class Reply:
    """Answer a node's spec (``msg_id`` None: not de-duplicated, a retry gets its own)."""

    answer: NodeJoined
    msg_id: str | None


@dataclass(frozen=True)
class Decided:
    """Publish a decision; ``why`` is its metrics label (the fault's cause, or what led to it)."""

    decision: PlanDecision
    msg_id: str
    why: str


@dataclass(frozen=True)
class Announce:
    """Publish the committed plan of ``generation`` and send it again until every member
    acknowledged it. ``resend``: a new leader's, sent on the next round, not at once.
    A generation the same step went past (two decisions in one step) is not sent:
    only the plan in the committed record is."""

    generation: int
    resend: bool = False


@dataclass(frozen=True)
class Spawn:
    """Ask a node's launcher to start workers."""

    ask: SpawnWorkers
    msg_id: str


@dataclass(frozen=True)
class FaultTimes:
    """A fault as its recovery's metrics need it."""

    cause: str
    fault_at: float
    detected_at: float


@dataclass(frozen=True)
class Committed:
    """A generation was committed: a recovery opens (``fault`` known), a resize is counted."""

    generation: int
    incident: str | None
    old_world: int
    fault: FaultTimes | None = None


@dataclass(frozen=True)
class Detect:
    """A ``detect`` span no detector opened (a broken group: the grace was the detection)."""

    start: float
    attributes: dict[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class Traced:
    """The incident's ``plan`` span (input received -> record committed); the effects that
    follow it run in its trace context. ``root``: a trace of its own (a grow of the planner's)."""

    attributes: dict[str, str]
    action: str = ""
    reason: str = ""
    root: bool = False
    detect: Detect | None = None


@dataclass(frozen=True)
class ArmTimer:
    """(Re-)arm the job's timer ``name`` for ``deadline`` (wall time)."""

    name: str
    deadline: float


@dataclass(frozen=True)
class CancelTimer:
    name: str


@dataclass(frozen=True)
class Refuse:
    """The input cannot be taken: report it on the error subject with the reason."""

    why: str


@dataclass(frozen=True)
class Log:
    event: str
    level: str = "info"
    fields: dict[str, object] = field(default_factory=dict)


Effect = Reply | Decided | Announce | Spawn | Committed | Traced | ArmTimer | CancelTimer | Refuse | Log
