"""Scaling policies: pure functions from the job's state to a planned resize.

A :class:`ScalingPolicy` decides the planned changes, switched at a step boundary:
growing into ready spares, who takes the ranks the cluster reclaims (or the
shrink), a custom policy's proposals (:class:`~phalanx.policy.PolicyClient`),
the cool-down after a change of members, and how long a worker a launcher was
asked to start has to register. The default, :class:`GrowIntoSpares`, grows up to
the largest allowed size the ready spares reach (``elastic.auto_grow``). Swap it
with ``ElasticityPlanner(bus, scaling=MyScaling())`` (:mod:`.service`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from phalanx.services.elasticity_planner.decisions import Decision, largest_allowed, size_rule, whole_groups

from phalanx.contract import Action, JobPhase, JobState, Member


class ScalingPolicy(Protocol):
    spawn_timeout_s: float  # a worker asked for and not registered by then is given up

    def on_spares(self, state: JobState) -> Decision | None:
        """Spares are ready and the job is running: grow (a planned GROW), or None."""

    def on_preemption(self, state: JobState, workers: list[str], why: str, leave_by: float) -> Decision:
        """The cluster takes ``workers`` back by ``leave_by``: who takes their ranks, who leaves."""

    def on_proposal(self, state: JobState, world: int, why: str) -> Decision:
        """A custom policy asks for ``world`` ranks: a planned GROW/SHRINK, or REJECT with the reason."""

    def cooldown_left(self, state: JobState, now: float) -> float:
        """Seconds until the job may grow again after its last change of members (<= 0: now)."""


@dataclass(frozen=True)
class GrowIntoSpares:
    spawn_timeout_s: float = 120.0

    def cooldown_left(self, state: JobState, now: float) -> float:
        return state.changed_at + state.spec.elastic.cooldown_s - now

    def on_spares(self, state: JobState) -> Decision | None:
        """Grow into registered spares up to the largest allowed size they reach."""
        plan = state.plan
        if plan is None or not state.spec.elastic.auto_grow:
            return None
        spares = state.usable_spares()
        target = largest_allowed(state, min(state.max_world_size, plan.world_size + len(spares)))
        if target is None or target <= plan.world_size:
            return None
        return self._grow(state, target, f"{len(spares)} spare(s) ready")

    def on_preemption(self, state: JobState, workers: list[str], why: str, leave_by: float) -> Decision:
        plan = state.plan
        assert plan is not None
        gone = set(workers)
        members = [m.worker for m in sorted(plan.members, key=lambda m: m.rank)]
        leaving_members = [w for w in members if w in gone]
        leaving_spares = [w for w in workers if w in state.spares]
        if not leaving_members:  # the spares learn it from a generation of the same members
            return Decision(
                Action.REFORM,
                f"{why}: no member affected; spare(s) {leaving_spares} leave",
                members=list(plan.members),
                leaving=leaving_spares,
                planned=True,
                leave_by=leave_by,
            )
        spares = state.usable_spares(exclude=gone)
        taken = dict(zip(leaving_members, spares, strict=False))
        slots = [None if w in gone and w not in taken else taken.get(w, w) for w in members]
        order, broken = whole_groups(slots, state.spec.elastic.group_size)
        size = largest_allowed(state, len(order))
        if size is None:
            return Decision(
                Action.STOP,
                f"{why}: {len(order)} ranks would be left, below min_world_size={state.min_world_size} "
                "(or no allowed size fits): stopping the job",
                leaving=[*leaving_members, *leaving_spares, *broken],
                planned=True,
                leave_by=leave_by,
            )
        extra = [*order[size:], *broken]
        how = ", ".join(f"spare {s} takes {w}'s rank {plan.rank_of(w)}" for w, s in taken.items())
        action = Action.REPLACE if size == plan.world_size and not extra else Action.SHRINK
        reason = (
            f"{why}: {how or 'no spare'}; {'keep' if action is Action.REPLACE else 'shrink to'} {size} ranks"
        )
        if broken:
            reason += f" ({broken} leave too: their replica group lost a member)"
        if order[size:]:
            reason += f" ({order[size:]} leave too: {len(order)} is not an allowed size)"
        return Decision(
            action,
            reason,
            members=[Member(rank=i, worker=w) for i, w in enumerate(order[:size])],
            spares_used=list(taken.values()),
            leaving=[*leaving_members, *leaving_spares, *extra],
            planned=True,
            leave_by=leave_by,
        )

    def on_proposal(self, state: JobState, world: int, why: str) -> Decision:
        plan = state.plan
        if plan is None or state.phase is not JobPhase.RUNNING:
            return Decision(
                Action.REJECT, f"the job is {state.phase.value}, not running: propose again later"
            )
        now = plan.world_size
        if world == now:
            return Decision(Action.REJECT, f"the job already runs {now} ranks")
        if not state.allowed(world):
            return Decision(Action.REJECT, f"{world} ranks is not allowed: {size_rule(state)}")
        if world > now:
            spares = state.usable_spares()
            if len(spares) < world - now:
                return Decision(
                    Action.REJECT, f"growing {now}->{world} needs {world - now} spare(s), {len(spares)} ready"
                )
            return self._grow(state, world, why)
        members = [m.worker for m in sorted(plan.members, key=lambda m: m.rank)]
        return Decision(
            Action.SHRINK,
            f"{why}: shrink {now}->{world}; {members[world:]} leave",
            members=[Member(rank=i, worker=w) for i, w in enumerate(members[:world])],
            leaving=members[world:],
            planned=True,
        )

    @staticmethod
    def _grow(state: JobState, target: int, why: str) -> Decision:
        plan = state.plan
        assert plan is not None
        joining = state.usable_spares()[: target - plan.world_size]
        members = sorted(plan.members, key=lambda m: m.rank)
        members += [Member(rank=plan.world_size + i, worker=w) for i, w in enumerate(joining)]
        return Decision(
            Action.GROW,
            f"{why}: grow {plan.world_size}->{target}, {joining} join",
            members=members,
            spares_used=joining,
            planned=True,
        )
