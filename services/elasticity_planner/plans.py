"""Turning a decision into the next generation: the plan, the decision event, spares.

Everything here works on the private copy of one job's state inside a step
(:class:`Ctx`) and only appends effects; the reducer (:mod:`.reducer`) decides what
to apply. A plan is built complete but for what the service stamps at commit
(:mod:`.service`): the leader's fencing token, the generation's random rendezvous
secret and the trace context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from phalanx.services.elasticity_planner.decisions import Decision
from phalanx.services.elasticity_planner.effects import (
    Announce,
    Committed,
    Decided,
    Effect,
    FaultTimes,
    Log,
    Spawn,
)
from phalanx.services.elasticity_planner.failure_policy import FailurePolicy
from phalanx.services.elasticity_planner.scaling_policy import ScalingPolicy

from phalanx.batchplan import plan_for
from phalanx.contract import Action, BatchPlan, JobPhase, JobState, Member, Plan, PlanDecision, SpawnWorkers
from phalanx.worker.addr import split_addr


@dataclass
class Ctx:
    """One step on one job: its state (a private copy), the time, what led to it."""

    state: JobState
    now: float
    trigger: str  # the ``why`` of decisions no fault explains (node_join, registration, ...)
    failure: FailurePolicy
    scaling: ScalingPolicy
    effects: list[Effect] = field(default_factory=list)
    faults: dict[str, FaultTimes] = field(default_factory=dict)  # incidents decided in this step

    @property
    def job(self) -> str:
        return self.state.spec.job

    def emit(self, effect: Effect) -> None:
        self.effects.append(effect)

    def log(self, event: str, level: str = "info", **fields: object) -> None:
        self.effects.append(Log(event, level, {"job": self.job, **fields}))

    def decided(
        self,
        incident: str | None,
        action: Action,
        reason: str,
        generation: int | None,
        key: str,
        *,
        world_size: int | None = None,
        proposal: str | None = None,
        batch: BatchPlan | None = None,
    ) -> None:
        event = PlanDecision(
            job=self.job,
            ts=self.now,
            incident=incident,
            action=action,
            reason=reason,
            generation=generation,
            world_size=world_size,
            proposal=proposal,
            batch=batch,
        )
        why = self.faults[incident].cause if incident in self.faults else self.trigger or "other"
        why = "proposal" if proposal is not None else why
        self.emit(Decided(event, f"{self.job}:{self.state.run}:decision:{key}", why))


def apply(ctx: Ctx, incident: str | None, d: Decision, proposal: str | None = None) -> None:
    """Apply a decision to the job's state: fence, use spares, commit the next generation."""
    state, now = ctx.state, ctx.now
    for w in d.removed:
        if w not in state.lost and (node := state.node_of(w)) is not None:
            # The slot of a worker that failed is not used again until the cluster
            # offers capacity on that node again: a faulty device is not crash-looped.
            state.node(node).slots = max(0, slots(state, node) - 1)
        state.lost.add(w)
        if w in state.spares:
            state.spares.remove(w)
    for w in d.leaving:
        state.lost.add(w)
        if w in state.spares:
            state.spares.remove(w)
    for w in d.spares_used:
        state.spares.remove(w)
    generation = None
    batch: BatchPlan | None = None
    if d.members is not None:
        generation = state.generation + 1
        batch = plan_for(state.spec.elastic, state.spec.global_batch, len(d.members))
        if state.plan is None or len(d.members) != state.plan.world_size or d.spares_used:
            state.changed_at = now
        workers = [m.worker for m in d.members] + state.spares
        where = state.worker_nodes()
        plan = Plan(
            job=ctx.job,
            ts=now,
            generation=generation,
            members=d.members,
            spares=list(state.spares),
            removed=d.removed,
            incident=incident,
            reason=d.reason,
            store_prefix=f"{ctx.job}/gen{generation}",
            store_addr=(root := _store_for(state)),
            store_addrs=_spread_stores(state, root),
            launch=state.run,
            group_size=state.spec.elastic.group_size,
            nodes={w: n for w in workers if (n := where.get(w)) is not None},
            lost_launchers=list(state.lost_launchers),
            lost_hosts=_lost_hosts(state),
            planned=d.planned,
            leaving=d.leaving,
            leave_by=d.leave_by or (now + state.spec.elastic.grace_s if d.leaving else 0.0),
            batch=batch,
            shrunk=shrunk_ranks(state.plan, d.members),
        )
        fault = ctx.faults.get(incident) if incident else None
        ctx.emit(Committed(generation, incident, state.plan.world_size if state.plan else 0, fault))
        if d.action is not Action.REFORM:
            state.reforms = 0
        state.broken, state.broken_at = {}, 0.0
        state.timers.pop("reform", None)
        state.plan = plan
        if incident is None:  # the first generation: no recovery waits on its acknowledgements
            state.acked = generation
        ctx.emit(Announce(generation))
    elif d.action is Action.STOP:
        state.phase = JobPhase.STOPPED
    reason = d.reason
    if batch is not None and d.action is not Action.REFORM:
        reason += f"; {batch.describe()}"
    ctx.decided(
        incident,
        d.action,
        reason,
        generation,
        key=proposal or incident or "start",
        world_size=len(d.members) if d.members is not None else None,
        proposal=proposal,
        batch=batch,
    )
    if not state.phase.ended:
        refill(ctx)
    else:
        state.timers.clear()
        state.deferred = []


def shrunk_ranks(prev: Plan | None, members: list[Member]) -> list[int]:
    """The previous generation's ranks left out when ``members`` are exactly its members
    minus them, in the same order, with no one joining (``Plan.shrunk``: an NCCL
    communicator may then be shrunk instead of built again); [] otherwise."""
    if prev is None:
        return []
    new = [m.worker for m in sorted(members, key=lambda m: m.rank)]
    old = [m.worker for m in sorted(prev.members, key=lambda m: m.rank)]
    kept = set(new)
    left = [r for r, w in enumerate(old) if w not in kept]
    if not left or len(left) > 4096 or new != [w for w in old if w in kept]:
        return []
    return left


def _lost_hosts(state: JobState) -> list[str]:
    """The addresses of lost nodes that no live node shares (a cut must never hit a live peer)."""
    live = {split_addr(s.store_addr)[0] for s in state.nodes.values() if not s.lost and s.store_addr}
    lost = {split_addr(s.store_addr)[0] for s in state.nodes.values() if s.lost and s.store_addr}
    return sorted(lost - live)


def _store_for(state: JobState) -> str:
    """The current generation's store while its node lives, else the first live node's."""
    current = state.plan.store_addr if state.plan else ""
    if any(s.store_addr == current and not s.lost for s in state.nodes.values()):
        return current
    return next((s.store_addr for s in state.nodes.values() if not s.lost), "")


MAX_SPREAD_STORES = 63


def _spread_stores(state: JobState, root: str) -> list[str]:
    """Up to 63 other live nodes' stores, a large generation's rendezvous keys are spread
    over besides the root (phalanx.runtime.rendezvous; ignored below its size threshold):
    the same for every member, by node name, so that a lost node moves few keys."""
    live = sorted(n for n, s in state.nodes.items() if not s.lost and s.store_addr and s.store_addr != root)
    return list(dict.fromkeys(state.nodes[n].store_addr for n in live))[:MAX_SPREAD_STORES]


def slots(state: JobState, node: str) -> int:
    n = state.nodes[node]
    return len(n.workers) if n.slots < 0 else n.slots


def refill(ctx: Ctx) -> None:
    """Ask launchers to start spares where the job has free slots and a use for them:
    to grow back to its largest size, and to keep the hot spares it started with."""
    state, now = ctx.state, ctx.now
    if state.plan is None or state.phase.ended:
        return
    for w, at in list(state.spawned.items()):  # asked for and never registered
        if now - at > ctx.scaling.spawn_timeout_s:
            ctx.log("spawn_timed_out", "warning", worker=w)
            state.spawned.pop(w)
            state.lost.add(w)
    reserve = sum(n.reserve for n in state.nodes.values() if not n.lost)
    want = state.max_world_size - state.world_size + reserve - len(state.usable_spares()) - len(state.spawned)
    for node in state.live_nodes():
        if want <= 0:
            return
        free = slots(state, node) - len(state.alive(node))
        count = min(free, want)
        if count <= 0:
            continue
        names = new_names(state, node, count)
        state.node(node).workers.extend(names)
        for w in names:
            state.spawned[w] = now
        want -= count
        reason = f"{free} free slot(s) on {node}: start {names} as hot spare(s)"
        n = state.nodes[node]
        ask = SpawnWorkers(
            job=ctx.job, ts=now, node=node, launcher=n.launcher, run=state.run, workers=names, reason=reason
        )
        key = f"spawn:{state.run}:{names[0]}"
        ctx.emit(Spawn(ask, f"{ctx.job}:{key}"))
        ctx.decided(None, Action.SPAWN, reason, None, key=key)


def new_names(state: JobState, node: str, count: int) -> list[str]:
    """Fresh worker names on ``node`` (never reused within the run)."""
    first = state.nodes[node].workers[0] if state.nodes[node].workers else f"{node}-w0"
    return numbered(state, re.sub(r"\d+$", "", first), count)


def numbered(state: JobState, stem: str, count: int) -> list[str]:
    """``count`` names ``<stem><n>`` numbered after every such name the run used."""
    used = {w for s in state.nodes.values() for w in s.workers}
    taken = [int(m.group(1)) for w in used if (m := re.fullmatch(re.escape(stem) + r"(\d+)", w))]
    start = max(taken, default=-1) + 1
    return [f"{stem}{start + i}" for i in range(count)]
