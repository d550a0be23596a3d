"""What the verdict rules learn from heartbeats about a generation's collectives: who
waits in which one (:class:`Waiting`), and who left them (:class:`Left`). Learned by
:class:`~.rules.Rules`, read by it and by :class:`~.wedges.Wedges`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Left", "Waiting"]


@dataclass(slots=True)
class Waiting:
    """The workers of one (job, generation) heard waiting in one collective of one step."""

    step: int
    """Steps they had completed (a straggler at the same count owes them this step)."""
    op: int
    """Which collective of the step (the count entered, ``Heartbeat.op``): a straggler
    at a lower count owes them this one."""
    since: float
    """When (monotonic) the first of them entered COLLECTIVE."""
    reach_s: float
    """The longest any of them took from its step's start to the collective."""
    workers: set[str] = field(default_factory=set)
    last: float = 0.0
    """When (monotonic) the last of them entered COLLECTIVE."""
    bound_s: float = 0.0
    """The largest per-op bound any of them reported (seconds)."""


@dataclass(slots=True)
class Left:
    """The workers of one (job, generation) heard RECOVERING, and when (monotonic) they left."""

    first: float
    workers: dict[str, float] = field(default_factory=dict)
