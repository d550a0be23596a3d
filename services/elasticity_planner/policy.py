"""Fault policies: pure functions from the job's state and a fault to a decision.

The planner applies whatever a policy decides; a user can swap in their own
(``ElasticityPlanner(bus, policy=MyPolicy())``) or publish proposals on the
event streams. The default, :class:`ReplaceOrShrink`, keeps the world size by
giving the lost rank's index to a hot spare (so the run stays bitwise equal to a
fault-free one), shrinks when no spare is left and the job's minimum allows it,
and otherwise stops the job with the reason -- it never leaves a job waiting.

Spares are chosen by node: for a single lost rank, a spare on the same node
first (that node has the rank's data shards prepared), then one on another live
node; for a lost node, spares on the other nodes only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from phalanx.schemas import Action, JobSpec, Member, Plan


class JobPhase(StrEnum):
    WAITING = "waiting"  # nodes joining, not all ranks registered yet
    RUNNING = "running"  # the current generation is acknowledged by all members
    RECOVERING = "recovering"  # a new generation is committed, acks outstanding
    STOPPED = "stopped"
    COMPLETED = "completed"


@dataclass
class NodeState:
    """One node's launcher in the job, as it joined."""

    launcher: str
    host: str
    store_addr: str
    workers: list[str]
    ranks: int  # how many of ``workers`` started as ranks
    lost: bool = False


@dataclass
class JobState:
    spec: JobSpec  # the first node's spec: the run's settings
    run: str = ""  # the job-level run id every plan of this run carries
    phase: JobPhase = JobPhase.WAITING
    plan: Plan | None = None
    nodes: dict[str, NodeState] = field(default_factory=dict)  # in join order
    ranks: list[str] = field(default_factory=list)  # registered rank-role workers, in order
    spares: list[str] = field(default_factory=list)  # warm spares, first to be used first
    lost: set[str] = field(default_factory=set)
    lost_launchers: list[str] = field(default_factory=list)
    base_generation: int = 0  # the job's generation when this run began
    start_world: int = 0
    exited: set[str] = field(default_factory=set)  # workers their launcher saw die: corroboration
    reforms: int = 0  # re-forms of the same members in a row (backoff, cap)
    reform_at: float = 0.0  # wall time of the last re-form
    broken: dict[str, str] = field(default_factory=dict)  # worker -> its failed collective, this generation
    broken_at: float = 0.0  # wall time of the first such report
    deferred: list[dict[str, Any]] = field(default_factory=list)  # incidents waiting for spares to start

    @property
    def generation(self) -> int:
        return self.plan.generation if self.plan else self.base_generation

    @property
    def min_world_size(self) -> int:
        return self.spec.min_world_size or self.start_world

    def node_of(self, worker: str) -> str | None:
        return next((n for n, s in self.nodes.items() if worker in s.workers), None)

    def live_nodes(self) -> list[str]:
        return [n for n, s in self.nodes.items() if not s.lost]


def state_to_dict(state: JobState) -> dict[str, Any]:
    """The planner's part of the job's KV record (the plan is stored beside it)."""
    return {
        "spec": state.spec.model_dump(mode="json"),
        "run": state.run,
        "phase": state.phase.value,
        "nodes": {
            n: {
                "launcher": s.launcher,
                "host": s.host,
                "store_addr": s.store_addr,
                "workers": s.workers,
                "ranks": s.ranks,
                "lost": s.lost,
            }
            for n, s in state.nodes.items()
        },
        "ranks": list(state.ranks),
        "spares": list(state.spares),
        "lost": sorted(state.lost),
        "lost_launchers": list(state.lost_launchers),
        "base_generation": state.base_generation,
        "start_world": state.start_world,
        "exited": sorted(state.exited),
        "reforms": state.reforms,
        "reform_at": state.reform_at,
        "broken": dict(state.broken),
        "broken_at": state.broken_at,
        "deferred": [dict(d) for d in state.deferred],
    }


def state_from_dict(d: dict[str, Any], plan: Plan | None) -> JobState:
    return JobState(
        spec=JobSpec.model_validate(d["spec"]),
        run=str(d["run"]),
        phase=JobPhase(d["phase"]),
        plan=plan,
        nodes={n: NodeState(**s) for n, s in d["nodes"].items()},
        ranks=list(d["ranks"]),
        spares=list(d["spares"]),
        lost=set(d["lost"]),
        lost_launchers=list(d["lost_launchers"]),
        base_generation=int(d["base_generation"]),
        start_world=int(d["start_world"]),
        exited=set(d.get("exited", ())),
        reforms=int(d.get("reforms", 0)),
        reform_at=float(d.get("reform_at", 0.0)),
        broken=dict(d.get("broken", {})),
        broken_at=float(d.get("broken_at", 0.0)),
        deferred=[dict(x) for x in d.get("deferred", ())],
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

    def on_node_lost(self, state: JobState, node: str, cause: str) -> Decision: ...


def _spares_by_preference(state: JobState, prefer: str | None, exclude: str | None = None) -> list[str]:
    """Usable spares: those on ``prefer`` first, never those on ``exclude`` or a lost node."""
    usable = [
        s for s in state.spares if (n := state.node_of(s)) != exclude and not (n and state.nodes[n].lost)
    ]
    return sorted(usable, key=lambda s: state.node_of(s) != prefer)


class ReplaceOrShrink:
    def _ended(self, state: JobState, what: str) -> Decision | None:
        if state.phase in (JobPhase.STOPPED, JobPhase.COMPLETED):
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
            members = [Member(rank=m.rank, worker=taken.get(m.worker, m.worker)) for m in by_rank]
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
        order = [taken.get(m.worker, m.worker) for m in by_rank if m.worker not in lost or m.worker in taken]
        short = "no spare left" if not taken else f"only {len(taken)} spare(s) for {len(lost)} lost ranks"
        if len(order) >= state.min_world_size:
            members = [Member(rank=i, worker=w) for i, w in enumerate(order)]
            return Decision(
                Action.SHRINK,
                f"{what}, {short}: shrink to {len(order)} ranks",
                members=members,
                removed=list(lost),
                spares_used=list(taken.values()),
            )
        return Decision(
            Action.STOP,
            f"{what}, {short} and {len(order)} ranks is below "
            f"min_world_size={state.min_world_size}: stopping the job",
            removed=list(lost),
        )
