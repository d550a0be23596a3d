"""Failure policies: pure functions from the job's state and a fault to a decision.

The planner applies whatever its :class:`FailurePolicy` decides; a user can swap in
their own (``ElasticityPlanner(bus, failure=MyFailurePolicy())``, see
:mod:`.service`). The default, :class:`ReplaceOrShrink`, keeps the world size by
giving the lost rank's index to a hot spare (so the run stays bitwise equal to a
fault-free one), shrinks when no spare is left and the job's minimum allows it,
and otherwise stops the job with the reason -- it never leaves a job waiting.

A job recovered by restart (an unmodified torchrun script) keeps its members when a
process ends on a live node (``REFORM``: every member restarts in place, as torchrun's
group restart), and an exit of a process that ran an older generation than the plan's is
no fault at all (that plan restarts it anyway); its spares go to ranks of lost nodes and
hung processes.

Spares are chosen by node: for a single lost rank, a spare on the same node
first (that node has the rank's data shards prepared), then one on another live
node; for a lost node, spares on the other nodes only.

A broken group (members report failed collectives, nobody is found dead) is the
policy's too: :meth:`FailurePolicy.reform_wait` is the grace before the same
members re-form (doubling with each re-form in a row, capped), and
:meth:`FailurePolicy.on_broken` re-forms or, after ``max_reforms`` in a row,
stops. :meth:`FailurePolicy.spare_wait` is how long a shrink or stop waits for
spares that are still starting. Every time is an argument (``now``): no policy
reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from phalanx.services.elasticity_planner.decisions import Decision, Fault, largest_allowed, whole_groups

from phalanx.contract import Action, FaultCause, JobState, Member, Recovery


class FailurePolicy(Protocol):
    def on_fault(self, state: JobState, fault: Fault) -> Decision:
        """A member (or spare) crashed or hung: replace, shrink, stop, or hold."""

    def on_node_lost(self, state: JobState, node: str, cause: str) -> Decision:
        """Every worker of ``node`` is gone: one decision for all its ranks."""

    def on_broken(self, state: JobState, why: str, now: float) -> Decision:
        """Collectives failed and nobody was found dead: the same members re-form, or stop."""

    def reforms_in_a_row(self, state: JobState, now: float) -> int:
        """Re-forms of the same members in a row so far (the count restarts after a quiet while)."""

    def reform_wait(self, state: JobState, now: float) -> float:
        """Seconds from the first failed collective to the re-form of the same members."""

    def spare_wait(self, state: JobState) -> float:
        """Seconds a shrink or stop waits for spares still starting."""


def _spares_by_preference(state: JobState, prefer: str | None, exclude: str | None = None) -> list[str]:
    """Usable spares: those on ``prefer`` first, never those on ``exclude`` or a lost node."""
    where = state.worker_nodes()
    usable = [s for s in state.spares if (n := where.get(s)) != exclude and not (n and state.nodes[n].lost)]
    return sorted(usable, key=lambda s: where.get(s) != prefer)


@dataclass(frozen=True)
class ReplaceOrShrink:
    comm_grace_s: float = 2.0
    max_reforms: int = 5
    reform_backoff_max_s: float = 30.0
    spare_wait_s: float = 30.0

    def _ended(self, state: JobState, what: str) -> Decision | None:
        if state.phase.ended:
            return Decision(Action.HOLD, f"job is {state.phase.value}: {what} needs no plan")
        return None

    def on_fault(self, state: JobState, fault: Fault) -> Decision:
        plan = state.plan
        ended = self._ended(state, f"{fault.worker} {fault.cause}")
        if ended is not None:
            return ended
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
        if fault.cause == FaultCause.COLLECTIVE_WEDGED:
            if fault.generation is not None and fault.generation < plan.generation:
                return Decision(
                    Action.HOLD, f"a collective of generation {fault.generation} wedged: re-formed since"
                )
            # Nobody can be singled out: the same members re-form (an unmodified script's
            # restart in place, as its own process-group timeout would have brought later).
            return Decision(
                Action.REFORM,
                f"every member of generation {plan.generation} stuck inside the same collective "
                f"(judged on {fault.worker}): the same members re-form",
                members=list(plan.members),
            )
        if state.spec.recovery is Recovery.RESTART and not fault.hung:
            if fault.generation is not None and fault.generation < plan.generation:
                # Its process ran an older generation's script: the current plan already
                # starts every member afresh (the launcher restarts a member with no live
                # process of it), so a second restart would only spend the budget.
                return Decision(
                    Action.HOLD,
                    f"{fault.worker} {fault.cause} in generation {fault.generation}: generation "
                    f"{plan.generation} already restarts every member",
                )
            # A process of an unmodified script ended; its node, which reported the exit,
            # still has the slot. Its peers die of the broken collective too: keeping
            # the members (every one restarts) spends no spare on them, as torchrun
            # restarts its group in place.
            return Decision(
                Action.REFORM,
                f"{fault.worker} {fault.cause}: every member restarts in place (restart recovery)",
                members=list(plan.members),
            )
        return self._replace(
            state, [fault.worker], f"{fault.worker} {fault.cause}", state.node_of(fault.worker)
        )

    def on_node_lost(self, state: JobState, node: str, cause: str) -> Decision:
        ended = self._ended(state, f"node {node} {cause}")
        if ended is not None:
            return ended
        gone = [w for w in state.nodes[node].workers if w not in state.lost]
        spares = [w for w in gone if w in state.spares]
        members = [w for w in gone if state.plan is not None and state.plan.rank_of(w) is not None]
        what = f"node {node} {cause}"
        if not members:
            return Decision(
                Action.HOLD, f"{what}: no member on it; {len(spares)} spare(s) dropped", removed=gone
            )
        d = self._replace(state, members, what, prefer=None, exclude=node)
        return Decision(d.action, d.reason, d.members, removed=gone, spares_used=d.spares_used)

    def _replace(
        self, state: JobState, lost: list[str], what: str, prefer: str | None, exclude: str | None = None
    ) -> Decision:
        """Give each lost member's rank to a spare; shrink or stop when too few are left."""
        plan = state.plan
        assert plan is not None
        by_rank = sorted(plan.members, key=lambda m: m.rank)
        spares = _spares_by_preference(state, prefer, exclude)
        taken = dict(zip(sorted(lost, key=lambda w: plan.rank_of(w) or 0), spares, strict=False))
        if len(taken) == len(lost):
            members = [
                m if m.worker not in taken else Member(rank=m.rank, worker=taken[m.worker]) for m in by_rank
            ]
            how = ", ".join(
                f"hot spare {s}{' on ' + n if (n := state.node_of(s)) and n != 'local' else ''} takes "
                f"{w}'s rank {plan.rank_of(w)}"
                for w, s in taken.items()
            )
            return Decision(
                Action.REPLACE,
                f"{what}: {how}",
                members=members,
                removed=list(lost),
                spares_used=list(taken.values()),
            )
        slots = [
            None if m.worker in lost and m.worker not in taken else taken.get(m.worker, m.worker)
            for m in by_rank
        ]
        order, broken = whole_groups(slots, state.spec.elastic.group_size)
        short = "no spare left" if not taken else f"only {len(taken)} spare(s) for {len(lost)} lost ranks"
        size = largest_allowed(state, len(order))
        if size is not None:
            members = [Member(rank=i, worker=w) for i, w in enumerate(order[:size])]
            extra = order[size:]
            how = f"shrink to {size} ranks"
            if broken:
                how += f" by whole replica groups ({broken} leave: their group lost a member)"
            if extra:
                how += f" ({len(order)} is not an allowed size: {extra} leave)"
            return Decision(
                Action.SHRINK,
                f"{what}, {short}: {how}",
                members=members,
                removed=list(lost),
                spares_used=list(taken.values()),
                leaving=[*broken, *extra],
            )
        return Decision(
            Action.STOP,
            f"{what}, {short} and {len(order)} ranks (in whole replica groups) is below "
            f"min_world_size={state.min_world_size} (or no allowed size fits): stopping the job",
            removed=list(lost),
        )

    # -- a broken group with nobody to blame ------------------------------------------------
    def reforms_in_a_row(self, state: JobState, now: float) -> int:
        quiet = max(60.0, 2 * self.reform_backoff_max_s)  # this long without one: the count restarts
        return state.reforms if now - state.reform_at < quiet else 0

    def reform_wait(self, state: JobState, now: float) -> float:
        """The grace before the same members re-form: doubles with each re-form in a row."""
        return min(self.comm_grace_s * 2 ** self.reforms_in_a_row(state, now), self.reform_backoff_max_s)

    def on_broken(self, state: JobState, why: str, now: float) -> Decision:
        assert state.plan is not None
        row = self.reforms_in_a_row(state, now)
        if row >= self.max_reforms:
            return Decision(
                Action.STOP,
                f"{why}: the group broke {row + 1} times in a row (max_reforms={self.max_reforms}), stopping",
            )
        return Decision(
            Action.REFORM,
            f"{why} and no rank was found dead or hung within "
            f"{self.reform_wait(state, now):g}s: the same members re-form",
            members=list(state.plan.members),
        )

    def spare_wait(self, state: JobState) -> float:
        return self.spare_wait_s
