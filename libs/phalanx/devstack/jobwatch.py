"""Watching a job of the development stack: what happened to it (:class:`JobResult`,
filled from its events by :func:`observe`), when the planner ended it
(:func:`wait_ended`), and how far rank 0 got (:func:`last_logged_step`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.msg import Msg

from phalanx.bus import Bus
from phalanx.contract import (
    Action,
    CollectiveError,
    Message,
    NodeLost,
    Plan,
    PlanDecision,
    RankExited,
    RankFailed,
    RankHung,
    RecoveryDone,
)
from phalanx.contract.subjects import COMM_ERROR, DECISION, EXITED, FAILED, HUNG, NODE_LOST, PLAN, RECOVERED


@dataclass
class JobResult:
    job: str
    returncode: int
    wall_s: float
    faults: list[RankFailed | RankHung] = field(default_factory=list)
    decisions: list[PlanDecision] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    recoveries: list[RecoveryDone] = field(default_factory=list)
    node_losses: list[NodeLost] = field(default_factory=list)
    received_at: dict[str, float] = field(default_factory=dict)  # first receipt per incident
    node_returncodes: dict[str, int] = field(default_factory=dict)  # run_nodes: each launcher's exit
    actions_at: list[float] = field(default_factory=list)  # run_nodes: when each action ran
    exits: list[RankExited] = field(default_factory=list)  # worker processes that ended
    comm_errors: list[CollectiveError] = field(default_factory=list)  # failed collectives reported

    @property
    def world_size(self) -> int:
        """The world size of the newest plan seen (0 before the first)."""
        newest: Plan | None = None
        for plan in self.plans:
            if plan.supersedes(newest):
                newest = plan
        return newest.world_size if newest is not None else 0

    def observe(self, msg: object) -> None:
        if isinstance(msg, RankFailed | RankHung):
            self.received_at.setdefault(msg.incident, time.time())
            self.faults.append(msg)
        elif isinstance(msg, NodeLost):
            self.received_at.setdefault(msg.incident, time.time())
            self.node_losses.append(msg)
        elif isinstance(msg, PlanDecision):
            self.decisions.append(msg)
        elif isinstance(msg, Plan):
            self.plans.append(msg)
        elif isinstance(msg, RecoveryDone):
            self.recoveries.append(msg)
        elif isinstance(msg, RankExited):
            self.exits.append(msg)
        elif isinstance(msg, CollectiveError):
            self.comm_errors.append(msg)


async def observe(bus: Bus, job: str, result: JobResult) -> None:
    """From now on, ``job``'s faults, node losses, decisions, plans, recoveries, exits and
    failed collectives go into ``result`` as they arrive."""

    async def on_msg(msg: Message, raw: Msg) -> None:
        result.observe(msg)

    for subject in (FAILED, HUNG, NODE_LOST, DECISION, PLAN, RECOVERED, EXITED, COMM_ERROR):
        await bus.subscribe(subject.wildcard(job=job), on_msg, (subject.message,), trace_messages=False)


async def wait_ended(bus: Bus, job: str, timeout_s: float) -> PlanDecision:
    """The planner's decision that ended ``job`` (``stop`` or ``complete``), once it is made."""
    # Every decision of the job, from the first: later ones (a hold) may follow the stop.
    decisions = await bus.streams.tail(DECISION.format(job=job), PlanDecision)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            d = await decisions.next(min(0.5, max(0.0, deadline - time.monotonic())))
            if d is not None and d.msg.action in (Action.STOP, Action.COMPLETE):
                return d.msg
        raise TimeoutError(f"the planner did not end job {job} within {timeout_s:g}s")
    finally:
        await decisions.stop()


def last_logged_step(path: Path) -> int:
    """The highest step rank 0 logged so far (-1 before the first)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return -1
    steps = [json.loads(line).get("step", -1) for line in lines if line.strip().endswith("}")]
    return max(steps, default=-1)
