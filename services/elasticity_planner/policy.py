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

from collections.abc import Collection
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
    # Worker slots the job may use here: what it joined with, plus capacity the cluster
    # offered since, minus slots whose worker crashed (not reused until offered again),
    # 0 once the node is reclaimed. -1: not known yet (a record of an older planner).
    slots: int = -1
    reserve: int = 0  # hot spares the node brought: kept up by asking its launcher for more


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
    changed_at: float = 0.0  # wall time of the last change of members (the grow cool-down)
    offered: dict[str, int] = field(default_factory=dict)  # node -> the cluster's offer last seen
    spawned: dict[str, float] = field(default_factory=dict)  # worker a launcher was asked to start -> when
    notices: list[str] = field(default_factory=list)  # proposals handled (newest last)
    sched_seq: int = 0  # the newest scheduler signal (PHALANX_SCHED sequence) this job took

    @property
    def generation(self) -> int:
        return self.plan.generation if self.plan else self.base_generation

    @property
    def min_world_size(self) -> int:
        return self.spec.min_world_size or self.start_world

    @property
    def max_world_size(self) -> int:
        return max(self.spec.elastic.max_world_size or self.start_world, self.min_world_size)

    @property
    def world_size(self) -> int:
        return self.plan.world_size if self.plan else 0

    def allowed(self, world: int) -> bool:
        """Whether the job may run at ``world`` ranks (min, max, allowed sizes)."""
        return self.min_world_size <= world <= self.max_world_size and self.spec.elastic.allowed(world)

    def usable_spares(self, exclude: Collection[str] = ()) -> list[str]:
        """Registered spares on live nodes, minus ``exclude``."""
        return [
            s
            for s in self.spares
            if s not in exclude and (n := self.node_of(s)) is not None and not self.nodes[n].lost
        ]

    def alive(self, node: str) -> list[str]:
        """Workers of ``node`` not lost or gone (ranks, spares and those starting)."""
        return [w for w in self.nodes[node].workers if w not in self.lost]

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
                "slots": s.slots,
                "reserve": s.reserve,
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
        "changed_at": state.changed_at,
        "offered": dict(state.offered),
        "spawned": dict(state.spawned),
        "notices": list(state.notices),
        "sched_seq": state.sched_seq,
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
        changed_at=float(d.get("changed_at", 0.0)),
        offered={str(k): int(v) for k, v in d.get("offered", {}).items()},
        spawned={str(k): float(v) for k, v in d.get("spawned", {}).items()},
        notices=list(d.get("notices", ())),
        sched_seq=int(d.get("sched_seq", 0)),
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
    leaving: list[str] = field(default_factory=list)  # leave gracefully (finish the step, exit 0)
    planned: bool = False  # switch at a step boundary, agreed in the gradient all-reduce
    leave_by: float = 0.0  # wall time after which the leaving are fenced


class Policy(Protocol):
    def on_fault(self, state: JobState, fault: Fault) -> Decision: ...

    def on_node_lost(self, state: JobState, node: str, cause: str) -> Decision: ...

    def on_spares(self, state: JobState) -> Decision | None:
        """Spares are ready and the job is running: grow (a planned GROW), or None."""

    def on_preemption(self, state: JobState, workers: list[str], why: str, leave_by: float) -> Decision:
        """The cluster takes ``workers`` back by ``leave_by``: who takes their ranks, who leaves."""

    def on_proposal(self, state: JobState, world: int, why: str) -> Decision:
        """A custom policy asks for ``world`` ranks: a planned GROW/SHRINK, or REJECT with the reason."""


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
        size = largest_allowed(state, len(order))
        if size is not None:
            members = [Member(rank=i, worker=w) for i, w in enumerate(order[:size])]
            extra = order[size:]
            how = f"shrink to {size} ranks"
            if extra:
                how += f" ({len(order)} is not an allowed size: {extra} leave)"
            return Decision(
                Action.SHRINK,
                f"{what}, {short}: {how}",
                members=members,
                removed=list(lost),
                spares_used=list(taken.values()),
                leaving=extra,
            )
        return Decision(
            Action.STOP,
            f"{what}, {short} and {len(order)} ranks is below "
            f"min_world_size={state.min_world_size} (or no allowed size fits): stopping the job",
            removed=list(lost),
        )

    # -- elasticity: planned changes at a step boundary ----------------------------------
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
        order = [taken.get(w, w) for w in members if w not in gone or w in taken]
        size = largest_allowed(state, len(order))
        if size is None:
            return Decision(
                Action.STOP,
                f"{why}: {len(order)} ranks would be left, below min_world_size={state.min_world_size} "
                "(or no allowed size fits): stopping the job",
                leaving=[*leaving_members, *leaving_spares],
                planned=True,
                leave_by=leave_by,
            )
        extra = order[size:]
        how = ", ".join(f"spare {s} takes {w}'s rank {plan.rank_of(w)}" for w, s in taken.items())
        action = Action.REPLACE if size == plan.world_size and not extra else Action.SHRINK
        reason = (
            f"{why}: {how or 'no spare'}; {'keep' if action is Action.REPLACE else 'shrink to'} {size} ranks"
        )
        if extra:
            reason += f" ({extra} leave too: {len(order)} is not an allowed size)"
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


def largest_allowed(state: JobState, at_most: int) -> int | None:
    """The largest world size the job may run at that is at most ``at_most``."""
    return next((n for n in range(min(at_most, state.max_world_size), 0, -1) if state.allowed(n)), None)


def size_rule(state: JobState) -> str:
    e = state.spec.elastic
    rule = f"min {state.min_world_size}, max {state.max_world_size}"
    if e.sizes:
        rule += f", sizes {e.sizes}"
    if e.size_step > 1:
        rule += f", multiples of {e.size_step}"
    return rule
