"""What a policy returns: a :class:`Decision`, and the job-size rules policies share.

A decision is data: the action, its reason, and when membership changes the new
generation's members, who is removed (fenced), which spares were used and who
leaves gracefully. The reducer (:mod:`.reducer`) turns it into the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.contract import Action, FaultCause, JobState, Member


@dataclass(frozen=True)
class Fault:
    """A rank's fault as a policy sees it."""

    incident: str
    worker: str
    cause: str
    hung: bool
    generation: int | None = None
    """The generation the verdict is on (None: the current one)."""


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    members: list[Member] | None = None  # the new generation's members, when it changes
    removed: list[str] = field(default_factory=list)
    spares_used: list[str] = field(default_factory=list)
    leaving: list[str] = field(default_factory=list)  # leave gracefully (finish the step, exit 0)
    planned: bool = False  # switch at a step boundary, agreed in the gradient all-reduce
    leave_by: float = 0.0  # wall time after which the leaving are fenced


def whole_groups(by_rank: list[str | None], group_size: int) -> tuple[list[str], list[str]]:
    """The workers of the replica groups with every member present, in rank order, and
    the present members of the groups that lost one (None in ``by_rank``). A sharded
    model's rank keeps its shard only when ranks go by whole groups: the first list
    renumbered from 0 keeps every rank's position in its group.

    >>> whole_groups(["w0", None, "w2", "w3"], 2)
    (['w2', 'w3'], ['w0'])
    >>> whole_groups(["w0", None, "w2"], 1)
    (['w0', 'w2'], [])
    """
    keep: list[str] = []
    broken: list[str] = []
    for start in range(0, len(by_rank), group_size):
        group = by_rank[start : start + group_size]
        present = [w for w in group if w is not None]
        (keep if len(present) == group_size else broken).extend(present)
    return keep, broken


def largest_allowed(state: JobState, at_most: int) -> int | None:
    """The largest world size the job may run at that is at most ``at_most``."""
    return next((n for n in range(min(at_most, state.max_world_size), 0, -1) if state.allowed(n)), None)


def size_rule(state: JobState) -> str:
    """The job's size rule, as a rejection states it."""
    e = state.spec.elastic
    rule = f"min {state.min_world_size}, max {state.max_world_size}"
    if e.sizes:
        rule += f", sizes {e.sizes}"
    if e.size_step > 1:
        rule += f", multiples of {e.size_step}"
    return rule


def cause_class(cause: str) -> str:
    """The ``cause`` label of a fault: crash, hang, collective_hang, node_lost, collective_error.

    >>> cause_class("process_exit"), cause_class("step_stall"), cause_class("collective_error")
    ('crash', 'hang', 'collective_error')
    """
    return {
        FaultCause.PROCESS_EXIT.value: "crash",
        FaultCause.HEARTBEAT_LOST.value: "hang",
        FaultCause.STEP_STALL.value: "hang",
        FaultCause.COLLECTIVE_HANG.value: "collective_hang",
        FaultCause.COLLECTIVE_WEDGED.value: "collective_hang",
    }.get(cause, cause)
