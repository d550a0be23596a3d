"""The planner's inputs, as data: every event :func:`~.reducer.Reducer.step` takes.

Each wraps the typed wire message it came from (already decoded and checked by
the bus) plus whatever the service knew that the message does not say: a fresh run
id for a spec (used only if it opens a new run), the cluster's current offer and
scheduler sequence, a stream sequence. :class:`TimerFired` is a deadline of the
job's record that came due; :class:`Resumed` is a leader taking the job over.
The events are pydantic models with a ``type`` tag, so a journal line
(:mod:`.journal`) is one event and the time it was handled.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from phalanx.contract import (
    CapacityChanged,
    CollectiveError,
    JobSpec,
    NodeLost,
    PreemptionNotice,
    Proposal,
    RankExited,
    RankFailed,
    RankHung,
    Registered,
)


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class JoinRequest(_Event):
    """A node's launcher asks to join (its :class:`JobSpec`)."""

    type: Literal["join"] = "join"
    msg: JobSpec
    run: str = Field(description="The run id to open if this spec starts a new run.")
    offered: int = Field(default=0, description="What the cluster offers on the spec's node now.")
    sched_seq: int = Field(default=0, description="The newest scheduler signal the service read.")


class Registration(_Event):
    type: Literal["registered"] = "registered"
    msg: Registered


class Failure(_Event):
    """The detector's verdict: a rank crashed."""

    type: Literal["failed"] = "failed"
    msg: RankFailed


class Hang(_Event):
    """The detector's verdict: a rank hung."""

    type: Literal["hung"] = "hung"
    msg: RankHung


class NodeLoss(_Event):
    type: Literal["node_lost"] = "node_lost"
    msg: NodeLost


class Exit(_Event):
    """A launcher saw one of its workers end (the node was checked against the record here)."""

    type: Literal["exited"] = "exited"
    msg: RankExited


class AllAcked(_Event):
    """Every member acknowledged ``generation``'s plan (the service counts the acks)."""

    type: Literal["acked"] = "acked"
    job: str
    generation: int


class CommFailure(_Event):
    type: Literal["comm_error"] = "comm_error"
    msg: CollectiveError


class Proposed(_Event):
    """A custom policy's proposal."""

    type: Literal["proposal"] = "proposal"
    msg: Proposal


class Capacity(_Event):
    """The cluster offers capacity (``seq``: the scheduler stream's sequence)."""

    type: Literal["capacity"] = "capacity"
    msg: CapacityChanged
    seq: int


class Preemption(_Event):
    """The cluster takes workers or nodes back (``seq``: the scheduler stream's sequence)."""

    type: Literal["preemption"] = "preemption"
    msg: PreemptionNotice
    seq: int


class TimerFired(_Event):
    """The job's timer ``name`` (a deadline in its record) came due."""

    type: Literal["timer"] = "timer"
    job: str
    name: str


class Resumed(_Event):
    """A leader took the job over from its record: arm its timers, resend an unacknowledged plan."""

    type: Literal["resumed"] = "resumed"
    job: str


Event = Annotated[
    JoinRequest
    | Registration
    | Failure
    | Hang
    | NodeLoss
    | Exit
    | AllAcked
    | CommFailure
    | Proposed
    | Capacity
    | Preemption
    | TimerFired
    | Resumed,
    Field(discriminator="type"),
]
EVENT: TypeAdapter[Event] = TypeAdapter(Event)


def job_of(event: Event) -> str | None:
    """The job an event is about (None: a cluster signal, for every job)."""
    if isinstance(event, AllAcked | TimerFired | Resumed):
        return event.job
    if isinstance(event, Capacity):
        return None
    if isinstance(event, Preemption):
        return event.msg.job
    return event.msg.job
