"""The planner's durable consumers, and the event each input message becomes.

Every consumer is durable (a planner restart loses nothing) and, but for the
recoveries' reports (metrics only), never drops an input (``max_deliver=-1``: a KV
outage is retried until it ends). A new leader rewinds the job inputs so what the
last leader held is delivered at once (:data:`REWOUND`); the scheduler's signals
are read again from the stream's start, which rebuilds the cluster's offers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.services.elasticity_planner import events as ev

from phalanx.contract import (
    CapacityChanged,
    CollectiveError,
    JobSpec,
    Message,
    NodeAck,
    NodeLost,
    PlanAck,
    PreemptionNotice,
    Proposal,
    RankExited,
    RankFailed,
    RankHung,
    RecoveryDone,
    Registered,
)
from phalanx.contract.streams import COMMANDS, EVENTS, SCHED, StreamSpec
from phalanx.contract.subjects import (
    ACK,
    CAPACITY,
    COMM_ERROR,
    EXITED,
    FAILED,
    HUNG,
    JOB_SPEC,
    NODE_ACK,
    NODE_LOST,
    PREEMPT,
    PROPOSAL,
    RECOVERED,
    REGISTERED,
    Subject,
)


@dataclass(frozen=True)
class Input:
    stream: StreamSpec
    durable: str
    subjects: tuple[Subject, ...]
    kinds: tuple[type[Message], ...]
    options: dict[str, float | int | bool] = field(default_factory=lambda: {"max_deliver": -1})

    def wildcards(self) -> list[str]:
        return [s.wildcard() for s in self.subjects]


JOB_INPUTS = (
    Input(COMMANDS, "planner-spec", (JOB_SPEC,), (JobSpec,)),
    Input(
        EVENTS,
        "planner-events",
        (REGISTERED, FAILED, HUNG, NODE_LOST, ACK, NODE_ACK, EXITED),
        (Registered, RankFailed, RankHung, NodeLost, PlanAck, NodeAck, RankExited),
        {"ack_wait_s": 10.0, "max_deliver": -1},
    ),
    Input(EVENTS, "planner-comm-errors", (COMM_ERROR,), (CollectiveError,)),
    Input(COMMANDS, "planner-proposals", (PROPOSAL,), (Proposal,)),
)
REWOUND = tuple((i.stream, i.durable) for i in JOB_INPUTS)
# Each rank's first step in a new generation: the recoveries' downtime (metrics only).
RECOVERIES = Input(EVENTS, "planner-recoveries", (RECOVERED,), (RecoveryDone,), {"deliver_new": True})
# Signals are about the cluster, not one job; each job's record says which it took (sched_seq).
SIGNALS = Input(SCHED, "planner-sched", (CAPACITY, PREEMPT), (CapacityChanged, PreemptionNotice))

_EVENTS: dict[type[Message], type[ev.Registration | ev.Failure | ev.Hang | ev.NodeLoss | ev.Exit]] = {
    Registered: ev.Registration,
    RankFailed: ev.Failure,
    RankHung: ev.Hang,
    NodeLost: ev.NodeLoss,
    RankExited: ev.Exit,
}


def event_of(msg: Message) -> ev.Event:
    """The event of a job input that needs nothing but the message (not a spec, not an ack)."""
    if isinstance(msg, CollectiveError):
        return ev.CommFailure(msg=msg)
    if isinstance(msg, Proposal):
        return ev.Proposed(msg=msg)
    return _EVENTS[type(msg)](msg=msg)  # type: ignore[arg-type]
