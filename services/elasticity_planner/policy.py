"""Fault policies: pure functions from the job's state and a fault to a decision.

The planner applies whatever a policy decides; a user can swap in their own
(``ElasticityPlanner(bus, policy=MyPolicy())``) or publish proposals on the
event streams. The default, :class:`ReplaceOrShrink`, keeps the world size by
giving the lost rank's index to a hot spare (so the run stays bitwise equal to a
fault-free one), shrinks when no spare is left and the job's minimum allows it,
and otherwise stops the job with the reason -- it never leaves a job waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from phalanx.schemas import Action, JobSpec, Member, Plan


class JobPhase(StrEnum):
    WAITING = "waiting"  # spec known, not all ranks registered yet
    RUNNING = "running"  # the current generation is acknowledged by all members
    RECOVERING = "recovering"  # a new generation is committed, acks outstanding
    STOPPED = "stopped"
    COMPLETED = "completed"


@dataclass
class JobState:
    spec: JobSpec
    phase: JobPhase = JobPhase.WAITING
    plan: Plan | None = None
    ranks: list[str] = field(default_factory=list)  # registered rank-role workers, in order
    spares: list[str] = field(default_factory=list)  # warm spares, first to be used first
    lost: set[str] = field(default_factory=set)
    acks: set[str] = field(default_factory=set)
    base_generation: int = 0  # the job's generation when this launch began

    @property
    def generation(self) -> int:
        return self.plan.generation if self.plan else self.base_generation


def state_to_dict(state: JobState) -> dict[str, Any]:
    return {
        "spec": state.spec.model_dump(mode="json"),
        "phase": state.phase.value,
        "plan": state.plan.model_dump(mode="json") if state.plan else None,
        "ranks": list(state.ranks),
        "spares": list(state.spares),
        "lost": sorted(state.lost),
        "base_generation": state.base_generation,
    }


def state_from_dict(d: dict[str, Any]) -> JobState:
    return JobState(
        spec=JobSpec.model_validate(d["spec"]),
        phase=JobPhase(d["phase"]),
        plan=Plan.model_validate(d["plan"]) if d["plan"] else None,
        ranks=list(d["ranks"]),
        spares=list(d["spares"]),
        lost=set(d["lost"]),
        base_generation=int(d.get("base_generation", 0)),
    )


@dataclass(frozen=True)
class Fault:
    incident: str
    worker: str
    cause: str
    hung: bool


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    members: list[Member] | None = None  # the new generation's members, when it changes
    removed: list[str] = field(default_factory=list)
    spares_used: list[str] = field(default_factory=list)


class Policy(Protocol):
    def on_fault(self, state: JobState, fault: Fault) -> Decision: ...


class ReplaceOrShrink:
    def on_fault(self, state: JobState, fault: Fault) -> Decision:
        plan = state.plan
        if state.phase in (JobPhase.STOPPED, JobPhase.COMPLETED):
            return Decision(
                Action.HOLD, f"job is {state.phase.value}: {fault.worker} {fault.cause} needs no plan"
            )
        if fault.worker in state.lost:
            return Decision(Action.HOLD, f"{fault.worker} already handled")
        if fault.worker in state.spares:
            return Decision(
                Action.HOLD,
                f"spare {fault.worker} lost ({fault.cause}); dropped from the pool",
                removed=[fault.worker],
            )
        if plan is None or plan.rank_of(fault.worker) is None:
            return Decision(Action.HOLD, f"{fault.worker} is not a member of generation {state.generation}")
        if state.spares:
            spare = state.spares[0]
            members = [
                Member(rank=m.rank, worker=spare if m.worker == fault.worker else m.worker)
                for m in plan.members
            ]
            return Decision(
                Action.REPLACE,
                f"{fault.worker} (rank {plan.rank_of(fault.worker)}) {fault.cause}: hot spare {spare} "
                f"takes its rank",
                members=members,
                removed=[fault.worker],
                spares_used=[spare],
            )
        survivors = [m.worker for m in sorted(plan.members, key=lambda m: m.rank) if m.worker != fault.worker]
        if len(survivors) >= state.spec.min_world_size:
            members = [Member(rank=i, worker=w) for i, w in enumerate(survivors)]
            return Decision(
                Action.SHRINK,
                f"{fault.worker} {fault.cause}, no spare left: shrink to {len(survivors)} ranks",
                members=members,
                removed=[fault.worker],
            )
        return Decision(
            Action.STOP,
            f"{fault.worker} {fault.cause}, no spare left and {len(survivors)} ranks is below "
            f"min_world_size={state.spec.min_world_size}: stopping the job",
            removed=[fault.worker],
        )
